"""RMS norms of Mamba (pre-norm) and Mamba-2 (gated, per group), computed in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension (float32 in, float32 out); torch's fused kernel."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gated_group_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_group: int, eps: float
) -> torch.Tensor:
    """Mamba-2's output norm: gate first (``y * silu(z)``), then RMS-normalise each of ``n_group`` groups.

    The gate comes before the norm (``norm_before_gate=False`` in mamba_ssm), as transformers and llama.cpp
    compute it; ``weight`` is ``[d_inner]`` (llama.cpp stores it as ``[n_group, d_inner / n_group]``).
    """
    g = y * F.silu(z)
    shape = g.shape
    g = g.reshape(*shape[:-1], n_group, shape[-1] // n_group)
    g = F.rms_norm(g, (g.shape[-1],), None, eps)
    return g.reshape(shape) * weight
