"""Small helpers the Mamba models share: dtype-aware projections and picking output rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` in the weight's dtype (bf16 matrices), returned as float32 for the residual stream."""
    if weight.dtype == x.dtype:
        return F.linear(x, weight)
    return F.linear(x.to(weight.dtype), weight).float()


def output_rows(hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The rows of ``hidden`` ``[Bs, L, d]`` (flattened to ``[Bs*L, d]``) whose logits are wanted."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    if len(rows) == flat.shape[0]:
        return flat
    if len(rows) == 1:
        return flat[rows[0] : rows[0] + 1]
    return flat.index_select(0, torch.tensor(rows, dtype=torch.long, device=flat.device))
