"""Truncation for the sampler: the candidates a row keeps (top-k, top-p, min-p), found without sorting
the whole vocabulary where a narrower slice provably holds them."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rsmem.engine.sampling_params import SamplingParams

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


def take_rows(x: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
    """Rows ``rows`` of ``x``, for reading: ``x`` itself when they are all of its rows in order, a view
    for one row, else a gathered copy (no advanced indexing, which can start a parallel region)."""
    if len(rows) == x.shape[0] and all(r == k for k, r in enumerate(rows)):
        return x
    if len(rows) == 1:
        return x[rows[0] : rows[0] + 1]
    return x.index_select(0, torch.tensor(rows, dtype=torch.long, device=x.device))


def _row_kind(p: SamplingParams, n_vocab: int) -> tuple[str, int]:
    """Which candidate path a row takes; it depends only on the row's own params (batch independence)."""
    if 0 < p.top_k < n_vocab:
        return ("top_k", p.top_k)
    if p.top_p >= 1.0 and p.min_p == 0.0:
        return ("all", 0)
    return ("nucleus", 0)


def candidates(x: torch.Tensor, params: Sequence[SamplingParams]) -> list[_Candidates]:
    """Run top-k, top-p, min-p and temperature for stochastic rows, grouped by candidate path."""
    groups: dict[tuple[str, int], list[int]] = {}
    for r, p in enumerate(params):
        groups.setdefault(_row_kind(p, x.shape[1]), []).append(r)
    out: list[_Candidates] = []
    for (kind, top_k), rows in groups.items():
        sub, sub_params = take_rows(x, rows), [params[r] for r in rows]
        if kind == "all":
            # No truncation: token-id order is already canonical, so skip sorting entirely.
            out.append(_Candidates(rows, apply_temperature(sub, sub_params), None))
        elif kind == "top_k":
            vals, ids = sorted_candidates(sub, top_k)
            vals = _truncate(vals, torch.logsumexp(vals, dim=-1), sub_params)
            out.append(_Candidates(rows, apply_temperature(vals, sub_params), ids))
        else:
            for local, vals, ids in _nucleus_candidates(sub, sub_params):
                temps = [sub_params[i] for i in local]
                out.append(_Candidates([rows[i] for i in local], apply_temperature(vals, temps), ids))
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
        vals, ids = sorted_candidates(take_rows(x, pending), width)
        kept = _truncate(
            vals, take_rows(log_norm.unsqueeze(1), pending).squeeze(1), [params[i] for i in pending]
        )
        n_kept = torch.isfinite(kept).sum(dim=-1)
        last_kept = vals.gather(1, (n_kept - 1).unsqueeze(1)).squeeze(1)
        exact = ((n_kept < width) & (last_kept > vals[:, -1])).tolist()
        good = [j for j, ok in enumerate(exact) if ok]
        if good:
            out.append(([pending[j] for j in good], take_rows(kept, good), take_rows(ids, good)))
        pending = [pending[j] for j, ok in enumerate(exact) if not ok]
    if pending:
        vals, ids = sorted_candidates(take_rows(x, pending), 0)
        out.append(
            (
                pending,
                _truncate(
                    vals, take_rows(log_norm.unsqueeze(1), pending).squeeze(1), [params[i] for i in pending]
                ),
                ids,
            )
        )
    return out


def sorted_candidates(x: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k stage: ``(logits, token ids)`` sorted by logit descending then id ascending.

    ``top_k == 0`` keeps all V tokens (a full stable sort); otherwise exactly ``top_k`` are kept, the
    lowest ids among logits tied with the k-th (``torch.topk`` finds the k-th without sorting the whole
    vocabulary), and then put in the same canonical order.
    """
    if top_k == 0:
        return torch.sort(x, dim=-1, descending=True, stable=True)
    # torch.topk picks arbitrarily among logits tied with the k-th: take the lowest ids among those
    kth = torch.topk(x, top_k, dim=-1, sorted=False).values.amin(dim=-1, keepdim=True)
    above, tied = x > kth, x == kth
    need = top_k - above.sum(dim=-1, keepdim=True)
    keep = above | (tied & (torch.cumsum(tied, dim=-1) <= need))
    ids = keep.nonzero()[:, 1].reshape(x.shape[0], top_k)  # ascending ids, k a row
    vals, order = torch.sort(x.gather(1, ids), dim=-1, descending=True, stable=True)
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


def apply_temperature(vals: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Divide by each row's temperature, last in the chain as in llama.cpp (so truncation sees T=1).

    Each row is first shifted by its maximum (softmax does not change), so a small temperature sends
    the others towards -inf instead of the maximum towards +inf.
    """
    shifted = vals - vals.amax(dim=-1, keepdim=True)
    return shifted / vals.new_tensor([p.temperature for p in params]).unsqueeze(1)
