"""RMS norms of Mamba (pre-norm) and Mamba-2 (gated, per group), computed in float32.

A prompt's norms run in C++ when the kernels are there (``csrc/gated_norm.cpp``: one pass instead of five
to seven torch kernels), by the rule of :mod:`rsmem.models.ops.conv`; the torch forms are their twins.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rsmem.kernels.build import loaded_native_ops, native_ops

NATIVE_MIN_TOKENS = 64  # as the prompt convolution's


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x) * weight`` over the last dimension (float32 in, float32 out). Several tokens
    ``[Bs, L, D]`` of float32 on the CPU go to the C++ kernel when it is there."""
    ops = _native(x, None, weight) if x.dim() == 3 and x.shape[1] > 1 else None
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
    ops = _native(y, z, weight) if y.dim() == 3 and y.shape[1] > 1 else None
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


def _native(y: torch.Tensor, z: torch.Tensor | None, weight: torch.Tensor) -> Any:
    """The kernels for this norm, or None: float32 CPU tensors with unit stride over the last dimension, the
    same shape, not inside a graph being compiled or one that records gradients, the kernels built."""
    tensors = (y, weight) if z is None else (y, z, weight)
    if torch.compiler.is_compiling() or (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)):
        return None
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return None
    if weight.numel() != y.shape[-1] or not _even_rows(y):
        return None
    if z is not None and (y.shape != z.shape or not _even_rows(z)):
        return None
    return native_ops() if y.shape[1] >= NATIVE_MIN_TOKENS else loaded_native_ops()


def _even_rows(t: torch.Tensor) -> bool:
    """Whether the token rows of ``t`` ``[Bs, L, D]`` have unit stride over D and are evenly spaced, apart
    (a column slice of a contiguous tensor is): the layouts the kernel reads."""
    bs, n, d = t.shape
    if t.stride(2) != 1:
        return False
    if n > 1:
        return (bs == 1 or t.stride(0) == n * t.stride(1)) and t.stride(1) >= d
    return bs == 1 or t.stride(0) >= d
