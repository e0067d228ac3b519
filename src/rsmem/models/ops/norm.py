"""RMS norms of Mamba (pre-norm) and Mamba-2 (gated, per group), computed in float32.

A prompt's norms run in C++ when the kernels are there (``csrc/gated_norm.cpp``: one pass instead of five
to seven torch kernels), by the rule of :func:`rsmem.kernels.build.prompt_ops`; the torch forms are their
twins.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rsmem.kernels.build import prompt_ops


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension (float32 in, float32 out). Several tokens
    ``[Bs, L, D]`` of float32 on the CPU go to the C++ kernel when it is there."""
    prompt = x.dim() == 3 and x.shape[1] > 1 and _kernel_layout(x, None, weight)
    ops = prompt_ops(x.shape[1], x, weight) if prompt else None
    if ops is not None:
        return ops.gated_rms_norm(x, x.new_empty(0), weight, 1, eps)
    return rms_norm_ref(x, weight, eps)


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The torch form of :func:`rms_norm` (torch's ``rms_norm``): the kernel's twin, the path elsewhere."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gated_group_rms_norm(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_group: int, eps: float
) -> torch.Tensor:
    """Mamba-2's output norm: gate first (``y * silu(z)``), then RMS-normalise each of ``n_group`` groups.

    The gate comes before the norm (``norm_before_gate=False`` in mamba_ssm), as transformers and llama.cpp
    compute it; ``weight`` is ``[d_inner]`` (llama.cpp stores it as ``[n_group, d_inner / n_group]``).
    Several tokens ``[Bs, L, d_inner]`` of float32 on the CPU go to the C++ kernel when it is there.
    """
    prompt = y.dim() == 3 and y.shape[1] > 1 and _kernel_layout(y, z, weight)
    ops = prompt_ops(y.shape[1], y, z, weight) if prompt else None
    if ops is not None:
        return ops.gated_rms_norm(y, z, weight, n_group, eps)
    return gated_group_rms_norm_ref(y, z, weight, n_group, eps)


def gated_group_rms_norm_ref(
    y: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, n_group: int, eps: float
) -> torch.Tensor:
    """The torch form of :func:`gated_group_rms_norm`: the C++ kernel's twin and the path elsewhere."""
    g = y * F.silu(z)
    shape = g.shape
    g = g.reshape(*shape[:-1], n_group, shape[-1] // n_group)
    g = F.rms_norm(g, (g.shape[-1],), None, eps)
    return g.reshape(shape) * weight


def _kernel_layout(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the kernel reads these ``[Bs, L, D]`` tensors as they lie: one weight a column, evenly
    spaced rows with unit stride over D, ``z`` shaped as ``y``."""
    if weight.numel() != y.shape[-1] or not _even_rows(y):
        return False
    return z is None or (y.shape == z.shape and _even_rows(z))


def _even_rows(t: torch.Tensor) -> bool:
    """Whether the token rows of ``t`` ``[Bs, L, D]`` have unit stride over D and are evenly spaced, apart
    (a column slice of a contiguous tensor is): the layouts the kernel reads."""
    bs, n, d = t.shape
    if t.stride(2) != 1:
        return False
    if n > 1:
        return (bs == 1 or t.stride(0) == n * t.stride(1)) and t.stride(1) >= d
    return bs == 1 or t.stride(0) >= d
