"""Token sampling for the generation engine: request parameters and a batched sampler.

The sampler follows llama.cpp's common sampler chain, applied per row of a ``[B, V]`` logits batch::

    logit bias -> penalties (repetition, presence, frequency) -> top-k -> top-p -> min-p
    -> temperature -> draw

Greedy rows (``temperature == 0``) take the argmax of the biased and penalised logits; truncation and
temperature cannot change the argmax, so they are skipped for those rows.

Reproducibility: every stochastic row draws exactly one uniform number per step from *its own*
``torch.Generator`` and picks its token by inverse CDF over its own candidates, which are ordered
canonically (probability descending, token id ascending on ties). Nothing a row computes depends on
the other rows of the batch, so a seeded request yields the same tokens whether it is sampled alone or
next to any other requests.

Log-probabilities, where a row asks for them, are taken from the model's distribution *after* logit
bias and penalties but *before* top-k/top-p/min-p truncation and temperature: that is the
distribution the request's own adjustments define, and it stays finite for every token that was not
banned, so a caller can score alternatives that truncation removed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rsmem.engine.sampling_params import (
    GREEDY_BELOW,
    MAX_LOGPROBS,
    SamplingParams,
    make_generator,
)
from rsmem.engine.truncation import candidates, take_rows
from rsmem.kernels.build import loaded_native_ops

__all__ = [
    "GREEDY_BELOW",
    "MAX_LOGPROBS",
    "Sampler",
    "SamplerOutput",
    "SamplingParams",
    "TokenLogprobs",
    "apply_penalties",
    "make_generator",
    "token_counts",
]


# --------------------------------------------------------------------------------------------------
# Sampler
# --------------------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class TokenLogprobs:
    """Log-probs of one sampled token: its own and the ``top`` alternatives (best first).

    Values come from ``log_softmax`` of the logits after bias and penalties, before truncation and
    temperature (see the module docstring for why).
    """

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@dataclass(slots=True)
class SamplerOutput:
    """One token per row; ``logprobs[i]`` is None for rows whose params have ``logprobs=None``.

    ``errors[i]`` says why row ``i`` could not be sampled (no finite maximum after bias and penalties:
    every token banned, or non-finite logits); its token is -1 and its generator did not move. Every
    other row is sampled exactly as it would be alone.
    """

    tokens: list[int]
    logprobs: list[TokenLogprobs | None]
    errors: list[str | None]


History = Sequence[int] | torch.Tensor


class Sampler:
    """Samples one token per row of a float logits batch ``[B, V]`` in one vectorised pass.

    Stateless: the per-request state (generator, history) is owned by the caller and passed in, so one
    sampler serves every batch. With ``native`` (the default) and rsmem's C++ kernels loaded, penalties and
    the rows that take top-k run in C++ (``kernels/csrc/sampler.cpp``; this module's torch code is its twin).
    """

    def __init__(self, native: bool = True) -> None:
        self.native = native

    def _ops(self) -> Any:
        return loaded_native_ops() if self.native else None

    def sample(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[History] | None = None,
        generators: Sequence[torch.Generator | None] | None = None,
    ) -> SamplerOutput:
        """Pick a token for each row.

        ``histories[i]`` are row ``i``'s prompt + generated tokens (only the last ``penalty_last_n``
        count); they are required when some row has penalties. ``generators[i]`` drives row ``i``'s
        single uniform draw; a None entry (or no list) falls back to torch's global generator, which
        gives no per-request reproducibility.
        """
        _check_batch(logits, params, histories, generators)
        n_rows = logits.shape[0]
        if _plain_greedy(params):
            # Common case: one argmax and no copy (NaN counts as the maximum, so the winners tell bad rows).
            best = torch.argmax(logits, dim=-1, keepdim=True)
            errors = _row_errors(logits.gather(1, best).squeeze(1).float())
            tokens = [-1 if e else t for t, e in zip(best.squeeze(1).tolist(), errors, strict=True)]
            return SamplerOutput(tokens, [None] * n_rows, errors)
        ops = self._ops()
        x = _adjusted_logits(logits, params, histories, ops)
        errors = _row_errors(x.amax(dim=-1))  # checked before any row draws
        tokens = [-1] * n_rows
        greedy = [i for i, p in enumerate(params) if p.is_greedy and errors[i] is None]
        if greedy:
            for i, t in zip(greedy, _argmax(take_rows(x, greedy)), strict=True):
                tokens[i] = t
        stochastic = [i for i, p in enumerate(params) if not p.is_greedy and errors[i] is None]
        if stochastic:
            uniforms = _draw_uniforms(stochastic, generators, x.device)
            native = [
                k for k, i in enumerate(stochastic) if ops is not None and 0 < params[i].top_k < x.shape[1]
            ]
            if native:
                rows, sub = [stochastic[k] for k in native], [params[stochastic[k]] for k in native]
                drawn = ops.sampler_top_k_draw(
                    x,
                    rows,
                    [p.top_k for p in sub],
                    [p.top_p for p in sub],
                    [p.min_p for p in sub],
                    [p.temperature for p in sub],
                    uniforms[native].tolist(),
                )
                for i, t in zip(rows, drawn, strict=True):
                    tokens[i] = t
            taken = set(native)
            rest = [k for k in range(len(stochastic)) if k not in taken]
            if rest:
                rows = [stochastic[k] for k in rest]
                picked = _sample_stochastic(take_rows(x, rows), [params[i] for i in rows], uniforms[rest])
                for i, t in zip(rows, picked, strict=True):
                    tokens[i] = t
        return SamplerOutput(tokens, _logprobs(x, params, tokens, errors), errors)

    __call__ = sample

    def distribution(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[History] | None = None,
    ) -> torch.Tensor:
        """The ``[B, V]`` float32 probabilities each row would be sampled from (one-hot for greedy rows).

        Runs the same chain as :meth:`sample`; useful to test or inspect what a request's parameters do.
        """
        _check_batch(logits, params, histories, None)
        x = _adjusted_logits(logits, params, histories)
        _require_finite(x.amax(dim=-1))
        probs = torch.zeros_like(x)
        greedy = [i for i, p in enumerate(params) if p.is_greedy]
        if greedy:
            probs[greedy, torch.tensor(_argmax(x[greedy]), dtype=torch.long)] = 1.0
        stochastic = [i for i, p in enumerate(params) if not p.is_greedy]
        if stochastic:
            probs[stochastic] = _stochastic_distribution(x[stochastic], [params[i] for i in stochastic])
        return probs


def _check_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History] | None,
    generators: Sequence[torch.Generator | None] | None,
) -> None:
    if logits.dim() != 2 or not logits.is_floating_point():
        raise ValueError(f"logits must be a floating [B, V] tensor, got {logits.dtype} {tuple(logits.shape)}")
    n_rows, n_vocab = logits.shape
    if n_vocab == 0:
        raise ValueError("logits have an empty vocabulary dimension")
    if len(params) != n_rows:
        raise ValueError(f"got {len(params)} SamplingParams for {n_rows} logit rows")
    if histories is not None and len(histories) != n_rows:
        raise ValueError(f"got {len(histories)} histories for {n_rows} logit rows")
    if generators is not None and len(generators) != n_rows:
        raise ValueError(f"got {len(generators)} generators for {n_rows} logit rows")
    if histories is None:
        needing = [i for i, p in enumerate(params) if p.has_penalties]
        if needing:
            raise ValueError(f"rows {needing} have penalties but no histories were given")


def _plain_greedy(params: Sequence[SamplingParams]) -> bool:
    return all(
        p.is_greedy and not p.logit_bias and not p.has_penalties and p.logprobs is None for p in params
    )


def _argmax(x: torch.Tensor) -> list[int]:
    """Row-wise argmax, the first index on ties (torch.max(dim) does not promise that; argmax does)."""
    return torch.argmax(x, dim=-1).tolist()


def _row_errors(row_max: torch.Tensor) -> list[str | None]:
    """A row whose maximum is -inf (everything banned), +inf or NaN has no well-defined distribution."""
    return [
        None if math.isfinite(m) else f"no usable maximum logit ({m}): every token banned, or non-finite"
        for m in row_max.tolist()
    ]


def _require_finite(row_max: torch.Tensor) -> None:
    bad = [e for e in _row_errors(row_max) if e is not None]
    if bad:
        raise ValueError(f"a logit row has {bad[0]}")


def _adjusted_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[History] | None,
    ops: Any = None,
) -> torch.Tensor:
    """float32 copy of the logits with bias and penalties applied (the stages every row shares)."""
    x = logits.to(torch.float32, copy=True)
    _apply_logit_bias(x, params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if rows:
        assert histories is not None  # _check_batch guarantees it
        penalize_seen(x, rows, [histories[i] for i in rows], [params[i] for i in rows], ops)
    return x


def penalize_seen(
    x: torch.Tensor,
    rows: Sequence[int],
    histories: Sequence[History],
    params: Sequence[SamplingParams],
    ops: Any = None,
) -> None:
    """:func:`apply_penalties` on rows ``rows`` of ``x`` (in place), touching only the tokens each row's
    window holds: one gather and one scatter for the batch instead of passes over the vocabulary. The
    arithmetic is :func:`apply_penalties`' own, element by element, so the results are the same bits."""
    n_vocab = x.shape[1]
    at_rows: list[int] = []
    at_cols: list[int] = []
    counts: list[int] = []
    rep: list[float] = []
    presence: list[float] = []
    frequency: list[float] = []
    for r, history, p in zip(rows, histories, params, strict=True):
        tokens = history.tolist() if isinstance(history, torch.Tensor) else history
        window = p.penalty_last_n
        seen = Counter(tokens if window < 0 else tokens[max(0, len(tokens) - window) :] if window else ())
        if seen and (min(seen) < 0 or max(seen) >= n_vocab):
            raise ValueError(f"history of row {r} has a token outside [0, {n_vocab})")
        at_rows += [r] * len(seen)
        at_cols += seen.keys()
        counts += seen.values()
        rep += [p.repetition_penalty] * len(seen)
        presence += [p.presence_penalty] * len(seen)
        frequency += [p.frequency_penalty] * len(seen)
    if not at_rows:
        return
    if ops is not None and x.stride(1) == 1:
        ops.sampler_penalize(x, at_rows, at_cols, counts, rep, presence, frequency)
        return
    index = (torch.tensor(at_rows), torch.tensor(at_cols))
    v = x[index]
    v = torch.where(v <= 0, v * v.new_tensor(rep), v / v.new_tensor(rep))
    v = v - v.new_tensor(presence) - v.new_tensor(frequency) * v.new_tensor(counts)
    x.index_put_(index, v)


def _apply_logit_bias(x: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    """Add every row's bias in one indexed accumulate (in place)."""
    rows: list[int] = []
    cols: list[int] = []
    vals: list[float] = []
    for i, p in enumerate(params):
        for token, amount in p.logit_bias or ():  # type: ignore[misc]
            rows.append(i)
            cols.append(token)
            vals.append(amount)
    if not rows:
        return
    if max(cols) >= x.shape[1]:
        raise ValueError(f"logit_bias names token {max(cols)} but the vocabulary has {x.shape[1]} tokens")
    index = (torch.tensor(rows, device=x.device), torch.tensor(cols, device=x.device))
    x.index_put_(index, torch.tensor(vals, dtype=x.dtype, device=x.device), accumulate=True)


def token_counts(histories: Sequence[History], windows: Sequence[int], n_vocab: int) -> torch.Tensor:
    """``[R, V]`` float32 counts of each token among the last ``windows[r]`` tokens of ``histories[r]``.

    Rows are padded with the out-of-vocabulary id ``n_vocab`` so one ``scatter_add_`` counts the whole
    batch; the padding column is dropped afterwards. A window of -1 means the whole history.
    """
    clipped: list[list[int]] = []
    for r, (history, window) in enumerate(zip(histories, windows, strict=True)):
        tokens = history.tolist() if isinstance(history, torch.Tensor) else list(history)
        tokens = tokens if window < 0 else tokens[max(0, len(tokens) - window) :] if window else []
        if tokens and (min(tokens) < 0 or max(tokens) >= n_vocab):
            raise ValueError(f"history of row {r} has a token outside [0, {n_vocab})")
        clipped.append(tokens)
    width = max((len(t) for t in clipped), default=0)
    padded = torch.tensor([t + [n_vocab] * (width - len(t)) for t in clipped], dtype=torch.long)
    padded = padded.reshape(len(clipped), width)
    counts = torch.zeros(len(clipped), n_vocab + 1, dtype=torch.float32)
    counts.scatter_add_(1, padded, torch.ones(padded.shape, dtype=torch.float32))
    return counts[:, :n_vocab]


def apply_penalties(x: torch.Tensor, counts: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Repetition (llama.cpp: ``l <= 0 ? l * p : l / p`` on seen tokens), then presence and frequency."""
    counts = counts.to(x.device)
    seen = counts > 0
    rep = x.new_tensor([p.repetition_penalty for p in params]).unsqueeze(1)
    presence = x.new_tensor([p.presence_penalty for p in params]).unsqueeze(1)
    frequency = x.new_tensor([p.frequency_penalty for p in params]).unsqueeze(1)
    x = torch.where(seen, torch.where(x <= 0, x * rep, x / rep), x)
    return x - presence * seen - frequency * counts


def _draw_uniforms(
    rows: Sequence[int], generators: Sequence[torch.Generator | None] | None, device: torch.device
) -> torch.Tensor:
    """One float64 uniform in [0, 1) per row, each from that row's own generator."""
    draws = []
    for i in rows:
        generator = generators[i] if generators is not None else None
        where = generator.device if generator is not None else "cpu"
        draws.append(torch.rand(1, dtype=torch.float64, generator=generator, device=where).item())
    return torch.tensor(draws, dtype=torch.float64, device=device)


def _sample_stochastic(
    x: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
) -> list[int]:
    """Inverse-CDF draw over each row's canonically ordered candidates."""
    tokens = [0] * x.shape[0]
    for group in candidates(x, params):
        positions = inverse_cdf(torch.softmax(group.vals, dim=-1), uniforms[group.rows]).unsqueeze(1)
        picked = positions if group.ids is None else group.ids.gather(1, positions)
        for r, t in zip(group.rows, picked.squeeze(1).tolist(), strict=True):
            tokens[r] = t
    return tokens


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Index of the first candidate whose cumulative mass exceeds ``u * total`` (float64 accumulation).

    Scaling by the row total rather than assuming 1 removes rounding bias; falling back to the last
    candidate with non-zero probability guards against ``u * total`` rounding up to the total. A
    zero-probability candidate can never be picked: its cdf equals its predecessor's.
    """
    cdf = torch.cumsum(probs.to(torch.float64), dim=-1)
    target = (uniforms * cdf[:, -1]).unsqueeze(1)
    positions = torch.searchsorted(cdf, target, right=True).squeeze(1)
    over = (positions >= probs.shape[1]).nonzero().squeeze(1)
    if over.numel():  # rare: only rows whose u * total rounded up to the total
        last = torch.argmax(torch.where(probs[over] > 0, cdf[over], -1.0), dim=-1)  # last token with mass
        positions[over] = last
    return positions


def _stochastic_distribution(x: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    probs = torch.zeros_like(x)
    for group in candidates(x, params):
        p = torch.softmax(group.vals, dim=-1)
        if group.ids is not None:
            p = torch.zeros(len(group.rows), x.shape[1], dtype=x.dtype, device=x.device).scatter_(
                1, group.ids, p
            )
        probs[group.rows] = p
    return probs


def _logprobs(
    x: torch.Tensor, params: Sequence[SamplingParams], tokens: Sequence[int], errors: Sequence[str | None]
) -> list[TokenLogprobs | None]:
    """Chosen-token and top-N log-probs for the sampled rows that asked, from one batched ``log_softmax``."""
    out: list[TokenLogprobs | None] = [None] * len(params)
    rows = [i for i, p in enumerate(params) if p.logprobs is not None and errors[i] is None]
    if not rows:
        return out
    logp = torch.log_softmax(x[rows], dim=-1)
    chosen = logp.gather(1, torch.tensor([tokens[i] for i in rows], device=x.device).unsqueeze(1))
    n_top = min(max(params[i].logprobs or 0 for i in rows), x.shape[1])
    top_vals, top_ids = torch.topk(logp, n_top, dim=-1)
    chosen_list, top_vals_list, top_ids_list = chosen.squeeze(1).tolist(), top_vals.tolist(), top_ids.tolist()
    for r, i in enumerate(rows):
        n = min(params[i].logprobs or 0, n_top)
        top = tuple(zip(top_ids_list[r][:n], top_vals_list[r][:n], strict=True))
        out[i] = TokenLogprobs(tokens[i], chosen_list[r], top)
    return out
