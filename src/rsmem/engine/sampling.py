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
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rsmem.errors import InvalidRequestError

# torch.Generator.manual_seed accepts exactly this range (negative seeds are folded onto positive ones).
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1

LogitBias = tuple[tuple[int, float], ...]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one request; ``None`` seeds it from ``os.urandom``.

    One generator per request (rather than torch's global one) is what makes a seeded request
    reproducible whatever else runs in the same batch.
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


def _fail(name: str, value: object, rule: str) -> InvalidRequestError:
    return InvalidRequestError(name, f"must be {rule}, got {value!r}")


def _as_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a top_k is almost surely a bug, so refuse it.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, "an int")
    return value


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, value, "a float")
    if not math.isfinite(value):
        raise _fail(name, value, "finite")
    return float(value)


def _normalise_bias(value: object) -> LogitBias | None:
    """Turn a mapping or pair sequence into sorted ``(token, bias)`` pairs, which keep the params hashable.

    ``-inf`` bans a token; ``+inf`` and NaN are refused because they would make softmax undefined.
    """
    if value is None:
        return None
    items: Any = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [tuple(item) for item in items]
    except TypeError as exc:
        raise _fail("logit_bias", value, "a mapping of token id to bias") from exc
    bias: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise _fail("logit_bias", value, "a mapping of token id to bias")
        token, amount = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _fail("logit_bias", value, f"keyed by token ids >= 0 (bad key {token!r})")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise _fail("logit_bias", value, f"valued by floats (bad value {amount!r})")
        if math.isnan(amount) or amount == math.inf:
            raise _fail("logit_bias", value, f"finite or -inf (bad value {amount!r} for token {token})")
        if token in bias:
            raise _fail("logit_bias", value, f"free of duplicate tokens (token {token} repeats)")
        bias[token] = float(amount)
    return tuple(sorted(bias.items())) or None


def _normalise_stop(value: object) -> tuple[str, ...]:
    # A bare string would otherwise become a tuple of its characters.
    given: Any = (value,) if isinstance(value, str) else value
    try:
        stops: tuple[object, ...] = tuple(given)
    except TypeError as exc:
        raise _fail("stop", value, "a tuple of strings") from exc
    for s in stops:
        if not isinstance(s, str) or not s:
            raise _fail("stop", value, f"non-empty strings (bad entry {s!r})")
    return stops  # type: ignore[return-value]  # checked above: every entry is a str


MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures below this are greedy
_INT_MAX = 2**31 - 1
_FLOAT_RANGES: dict[str, tuple[float, float, str]] = {
    "temperature": (0.0, 1e4, "in [0, 1e4] (0 means greedy)"),
    "top_p": (0.0, 1.0, "in (0, 1]"),
    "min_p": (0.0, 1.0, "in [0, 1]"),
    "repetition_penalty": (1e-3, 1e3, "in [1e-3, 1e3] (1 means off)"),
    "presence_penalty": (-1e3, 1e3, "in [-1e3, 1e3]"),
    "frequency_penalty": (-1e3, 1e3, "in [-1e3, 1e3]"),
}
_INT_RANGES: dict[str, tuple[int, int, str]] = {
    "top_k": (0, _INT_MAX, ">= 0 (0 means off)"),
    "penalty_last_n": (-1, _INT_MAX, ">= -1 (-1 means the whole history)"),
    "n": (1, _INT_MAX, ">= 1"),
}


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its tokens; validated on construction, immutable and hashable.

    ``temperature`` 0 means greedy. ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 switch those stages off.
    ``repetition_penalty`` (llama.cpp/HF style) divides positive and multiplies negative logits of
    tokens seen in the last ``penalty_last_n`` tokens of prompt + output (-1: all, 0: no penalties);
    ``presence_penalty``/``frequency_penalty`` (OpenAI style) subtract ``presence*[count>0] +
    frequency*count``. ``logit_bias`` is stored as sorted ``(token, bias)`` pairs (a mapping is
    accepted); ``-inf`` bans a token. ``logprobs`` is the number of top alternatives to report (0: only
    the chosen token's log-prob, None: nothing). ``max_tokens``, ``stop``, ``n`` and ``ignore_eos`` are
    for the engine's stopping and forking logic; the sampler itself does not read them.

    Ranges, checked here (an :class:`~rsmem.errors.InvalidRequestError` naming the field otherwise). The
    bounds keep every stage finite in float32 for finite logits, so no valid request can overflow:

    ====================== ================= ==============================================
    field                  range             off / meaning
    ====================== ================= ==============================================
    temperature            [0, 1e4]          0 (and anything below 1e-5): greedy
    top_k                  [0, 2**31-1]      0: off
    top_p                  (0, 1]            1: off
    min_p                  [0, 1]            0: off
    repetition_penalty     [1e-3, 1e3]       1: off
    presence_penalty       [-1e3, 1e3]       0: off
    frequency_penalty      [-1e3, 1e3]       0: off
    penalty_last_n         [-1, 2**31-1]     -1: the whole history, 0: no penalties
    logit_bias             token ids >= 0    values finite or -inf (bans the token)
    seed                   [-2**63, 2**64-1] None: drawn from os.urandom
    logprobs               [0, 20]           None: no log-probs
    max_tokens             >= 1              None: no limit (EOS, a stop string or abort)
    n                      [1, 2**31-1]      completions (the engine also bounds it by its sequences)
    stop                   non-empty strings
    ====================== ================= ==============================================
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: LogitBias | Mapping[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are stored through object.__setattr__
        for name, (low, high, rule) in _FLOAT_RANGES.items():
            value = _as_float(name, getattr(self, name))
            if not (low <= value <= high) or (name == "top_p" and value == 0.0):
                raise _fail(name, value, rule)
            set_(self, name, value)
        for name, (low, high, rule) in _INT_RANGES.items():
            if not low <= _as_int(name, getattr(self, name)) <= high:
                raise _fail(name, getattr(self, name), rule)
        self._validate_optional_ints()
        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", self.ignore_eos, "a bool")
        set_(self, "logit_bias", _normalise_bias(self.logit_bias))
        set_(self, "stop", _normalise_stop(self.stop))

    def _validate_optional_ints(self) -> None:
        if self.seed is not None and not _SEED_MIN <= _as_int("seed", self.seed) <= _SEED_MAX:
            raise _fail("seed", self.seed, f"in [{_SEED_MIN}, {_SEED_MAX}]")
        if self.logprobs is not None and not 0 <= _as_int("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise _fail("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or None")
        if self.max_tokens is not None and _as_int("max_tokens", self.max_tokens) < 1:
            raise _fail("max_tokens", self.max_tokens, ">= 1 or None (no limit)")

    @classmethod
    def greedy(cls, **overrides: object) -> SamplingParams:
        """Argmax decoding (``temperature=0``); other fields may be overridden."""
        return cls(temperature=0.0, **overrides)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` pick the argmax, as vLLM does: dividing by them would
        overflow float32, and what they sample from is the argmax within float precision."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Whether the penalty stage changes anything, i.e. whether the sampler needs the history."""
        active = (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
        return active and self.penalty_last_n != 0


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
    sampler serves every batch.
    """

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
        x = _adjusted_logits(logits, params, histories)
        errors = _row_errors(x.amax(dim=-1))  # checked before any row draws
        tokens = [-1] * n_rows
        greedy = [i for i, p in enumerate(params) if p.is_greedy and errors[i] is None]
        if greedy:
            for i, t in zip(greedy, _argmax(x[greedy]), strict=True):
                tokens[i] = t
        stochastic = [i for i, p in enumerate(params) if not p.is_greedy and errors[i] is None]
        if stochastic:
            uniforms = _draw_uniforms(stochastic, generators, x.device)
            picked = _sample_stochastic(x[stochastic], [params[i] for i in stochastic], uniforms)
            for i, t in zip(stochastic, picked, strict=True):
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
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History] | None
) -> torch.Tensor:
    """float32 copy of the logits with bias and penalties applied (the stages every row shares)."""
    x = logits.to(torch.float32, copy=True)
    _apply_logit_bias(x, params)
    rows = [i for i, p in enumerate(params) if p.has_penalties]
    if rows:
        assert histories is not None  # _check_batch guarantees it
        sub = [params[i] for i in rows]
        counts = token_counts([histories[i] for i in rows], [p.penalty_last_n for p in sub], x.shape[1])
        x[rows] = apply_penalties(x[rows], counts, sub)
    return x


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
        tokens = tokens if window < 0 else tokens[len(tokens) - window :] if window else []
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


# Widths of the partial sorts tried, in turn, for top-p/min-p rows without top-k before a full sort of
# the vocabulary (see _nucleus_candidates). Real model logits are peaked: the nucleus is usually small.
PRUNE_WIDTHS = (256, 4096)


@dataclass(slots=True)
class _Candidates:
    """Final candidates of some rows: ``vals`` are logits after truncation (-inf where dropped) and
    temperature, in the rows' canonical draw order; ``ids`` maps positions to tokens (None: identity)."""

    rows: list[int]
    vals: torch.Tensor
    ids: torch.Tensor | None


def _row_kind(p: SamplingParams, n_vocab: int) -> tuple[str, int]:
    """Which candidate path a row takes; it depends only on the row's own params (batch independence)."""
    if 0 < p.top_k < n_vocab:
        return ("top_k", p.top_k)
    if p.top_p >= 1.0 and p.min_p == 0.0:
        return ("all", 0)
    return ("nucleus", 0)


def _candidates(x: torch.Tensor, params: Sequence[SamplingParams]) -> list[_Candidates]:
    """Run top-k, top-p, min-p and temperature for stochastic rows, grouped by candidate path."""
    groups: dict[tuple[str, int], list[int]] = {}
    for r, p in enumerate(params):
        groups.setdefault(_row_kind(p, x.shape[1]), []).append(r)
    out: list[_Candidates] = []
    for (kind, top_k), rows in groups.items():
        sub, sub_params = x[rows], [params[r] for r in rows]
        if kind == "all":
            # No truncation: token-id order is already canonical, so skip sorting entirely.
            out.append(_Candidates(rows, _apply_temperature(sub, sub_params), None))
        elif kind == "top_k":
            vals, ids = sorted_candidates(sub, top_k)
            vals = _truncate(vals, torch.logsumexp(vals, dim=-1), sub_params)
            out.append(_Candidates(rows, _apply_temperature(vals, sub_params), ids))
        else:
            for local, vals, ids in _nucleus_candidates(sub, sub_params):
                temps = [sub_params[i] for i in local]
                out.append(_Candidates([rows[i] for i in local], _apply_temperature(vals, temps), ids))
    return out


def _nucleus_candidates(
    x: torch.Tensor, params: Sequence[SamplingParams]
) -> list[tuple[list[int], torch.Tensor, torch.Tensor]]:
    """Top-p/min-p over the whole vocabulary, sorting only the head of each row when that is exact.

    A full sort of V logits dominates the cost, so first only the best ``w`` (each of ``PRUNE_WIDTHS``
    in turn) are sorted. Top-p needs the full row's normaliser (``logsumexp`` over V), but a
    candidate's fate depends only on the mass *above* it. So the pruned result is exact when the cut
    falls inside the head and the last kept logit is strictly above the head's smallest one (no tie
    with unsorted tokens). Rows that fail every width get a full stable sort. Each decision uses only
    the row's own logits, so batch composition cannot change a row's result.
    """
    log_norm = torch.logsumexp(x, dim=-1)
    out: list[tuple[list[int], torch.Tensor, torch.Tensor]] = []
    pending = list(range(x.shape[0]))
    for width in PRUNE_WIDTHS:
        if width >= x.shape[1] or not pending:
            break
        vals, ids = sorted_candidates(x[pending], width)
        kept = _truncate(vals, log_norm[pending], [params[i] for i in pending])
        n_kept = torch.isfinite(kept).sum(dim=-1)
        last_kept = vals.gather(1, (n_kept - 1).unsqueeze(1)).squeeze(1)
        exact = ((n_kept < width) & (last_kept > vals[:, -1])).tolist()
        good = [j for j, ok in enumerate(exact) if ok]
        if good:
            out.append(([pending[j] for j in good], kept[good], ids[good]))
        pending = [pending[j] for j, ok in enumerate(exact) if not ok]
    if pending:
        vals, ids = sorted_candidates(x[pending], 0)
        out.append((pending, _truncate(vals, log_norm[pending], [params[i] for i in pending]), ids))
    return out


def sorted_candidates(x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k stage: ``(logits, token ids)`` sorted by logit descending then id ascending.

    ``top_k == 0`` keeps all V tokens (a full stable sort); otherwise exactly ``top_k`` are kept via
    ``torch.topk``, which avoids sorting the whole vocabulary, and then put in the same canonical order.
    """
    if top_k == 0:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    vals, ids = torch.topk(x, top_k, dim=-1, sorted=False)
    ids, order = torch.sort(ids, dim=-1)
    vals, order = torch.sort(vals.gather(1, order), dim=-1, descending=True, stable=True)
    return vals, ids.gather(1, order)


def _truncate(vals: torch.Tensor, log_norm: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vals = apply_top_p(vals, log_norm, vals.new_tensor([p.top_p for p in params]))
    return apply_min_p(vals, vals.new_tensor([p.min_p for p in params]))


def apply_top_p(vals: torch.Tensor, log_norm: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the shortest prefix of the sorted candidates whose probability mass reaches ``top_p``.

    Probabilities are ``exp(vals - log_norm)`` with ``log_norm`` the log-sum-exp over all candidates
    left by top-k (which may be more than ``vals`` holds). Candidate ``j`` survives iff the mass strictly
    before it is ``< top_p``, so the head always survives. Rows with ``top_p == 1`` are untouched (float
    rounding must not drop tiny tail tokens there).
    """
    probs = torch.exp(vals - log_norm.unsqueeze(1))
    before = torch.zeros_like(probs)
    before[:, 1:] = torch.cumsum(probs, dim=-1)[:, :-1]
    keep = (before < top_p.unsqueeze(1)) | (top_p >= 1.0).unsqueeze(1)
    keep[:, 0] = True  # the head always survives, even where top_p rounds to 0 in float32
    return vals.masked_fill(~keep, -math.inf)


def apply_min_p(vals: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop sorted candidates with ``prob < min_p * max_prob``, compared in logit space as llama.cpp does.

    ``p_j / p_max = exp(l_j - l_max)``, so the test needs no softmax and ignores earlier truncation.
    """
    threshold = vals[:, :1] + torch.log(min_p).unsqueeze(1)  # log(0) = -inf keeps everything
    return vals.masked_fill(vals < threshold, -math.inf)


def _apply_temperature(vals: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Divide by each row's temperature, last in the chain as in llama.cpp (so truncation sees T=1).

    Each row is first shifted by its maximum (softmax does not change), so a small temperature sends
    the others towards -inf instead of the maximum towards +inf.
    """
    shifted = vals - vals.amax(dim=-1, keepdim=True)
    return shifted / vals.new_tensor([p.temperature for p in params]).unsqueeze(1)


def _sample_stochastic(
    x: torch.Tensor, params: Sequence[SamplingParams], uniforms: torch.Tensor
) -> list[int]:
    """Inverse-CDF draw over each row's canonically ordered candidates."""
    tokens = [0] * x.shape[0]
    for group in _candidates(x, params):
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
    for group in _candidates(x, params):
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
