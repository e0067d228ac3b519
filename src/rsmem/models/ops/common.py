"""Small helpers the Mamba models share: dtype-aware projections, picking output rows, and the token loop
of the scans' reference twins."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

StateStep = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def linear(x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
    """``x @ weight_t`` in the weight's dtype (bf16 matrices), returned as float32 for the residual stream.

    Without oneDNN packing models keep their matrices transposed, ``[in, out]`` contiguous: on CPU the plain
    product beats ``F.linear`` on ``[out, in]`` for one or a few rows (decode). With packing they hold
    ``[in, out]`` views of ``[out, in]`` float32 matrices instead (see :mod:`rsmem.models.step.packed`), which
    bypass this function.
    """
    if weight_t.dtype == x.dtype:
        return torch.matmul(x, weight_t)
    return torch.matmul(x.to(weight_t.dtype), weight_t).float()


def transposed(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``[out, in]`` matrix as the ``[in, out]`` contiguous copy :func:`linear` expects."""
    return weight.to(dtype).t().contiguous()


def output_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows of ``hidden`` ``[Bs, L, d]`` (flattened to ``[Bs*L, d]``) whose logits are wanted."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if len(rows) == flat.shape[0]:
        return flat
    if len(rows) == 1:
        return flat[rows[0] : rows[0] + 1]
    return flat.index_select(0, torch.tensor(rows, dtype=torch.long, device=flat.device))


def scan_tokens(
    step: StateStep,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply a one-token ``step(h, x_t, dt_t, A, B_t, C_t, D) -> (y_t, h)`` to each of the ``L`` tokens
    (dimension 1 of ``x``, ``dt``, ``B``, ``C``); returns ``(y, h after the last token)``."""
    ys = []
    for t in range(x.shape[1]):
        y, h = step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        ys.append(y)
    return torch.stack(ys, dim=1), h


CapturePoints = Sequence[tuple[int, int]]  # (sequence index in the micro-batch, token offset)


def states_at_ref(
    step: StateStep,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    at: CapturePoints,
) -> torch.Tensor:
    """Token-by-token twin of a scan's states at points: the state of sequence ``b`` after its token ``t``
    for each ``(b, t)`` of ``at``, stacked: ``[len(at), *h.shape[1:]]``."""
    after = []
    for t in range(x.shape[1]):
        _, h = step(h, x[:, t], dt[:, t], A, B[:, t], C[:, t], D)
        after.append(h)
    return torch.stack([after[t][b] for b, t in at]) if at else h.new_empty(0, *h.shape[1:])
