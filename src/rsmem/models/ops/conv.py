"""Causal depthwise convolution over a rolling window (the ``r`` state).

The window holds the last ``K - 1`` inputs of each channel, oldest first: torch ``[Bs, C, K-1]``, which is
llama.cpp's ggml ``[K-1, C]`` row (fastest index first). transformers keeps ``K`` columns; llama.cpp and
rsmem keep ``K - 1`` because the newest column is always the current token.

A prompt's convolution runs in C++ when the kernels are there (``csrc/conv1d.cpp``, by the rule of
:func:`rsmem.kernels.build.prompt_ops`, as Mamba-2's scan): one pass from the in_proj slice to a contiguous
output. The torch form below is its reference twin and the path everywhere else.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rsmem.kernels.build import prompt_ops
from rsmem.models.ops.common import CapturePoints


def causal_conv1d_(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """Convolve ``x`` ``[Bs, L, C]`` after ``window`` ``[Bs, C, K-1]``, which is updated in place to the
    last ``K - 1`` inputs; returns ``y`` ``[Bs, L, C]``.

    ``weight`` is ``[C, K]`` (column ``K-1`` multiplies the current token). No activation is applied.
    Several tokens of float32 on the CPU go to the C++ kernel when it is there (contiguous ``y``).
    """
    n_tokens = x.shape[1]
    # a prompt in the kernel's layouts (one token is a decode step, compiled: its strides stay unread)
    if n_tokens > 1 and x.stride(2) == 1 and window.is_contiguous() and weight.dim() == 2:
        ops = prompt_ops(n_tokens, x, window, weight, *(() if bias is None else (bias,)))
        if ops is not None:
            return ops.conv1d_causal_(x, window, weight, x.new_empty(0) if bias is None else bias)
    xx = torch.cat([window, x.transpose(1, 2)], dim=2)  # [Bs, C, K-1+L]
    window.copy_(xx[:, :, n_tokens:])
    if n_tokens == 1:  # decode: one dot product per channel, no conv setup
        y = (xx * weight).sum(-1, keepdim=True)  # [Bs, C, 1]
        if bias is not None:
            y += bias.unsqueeze(-1)
    else:
        y = F.conv1d(xx, weight.unsqueeze(1), bias, groups=weight.shape[0])  # [Bs, C, L]
    return y.transpose(1, 2)


def causal_conv1d(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`causal_conv1d_` on a copy of ``window``; returns ``(y [Bs, L, C], new window)``."""
    window = window.clone()
    return causal_conv1d_(x, window, weight, bias), window


def causal_conv1d_ref(
    x: torch.Tensor, window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token twin of :func:`causal_conv1d`: shift the window, dot it with the kernel."""
    outs = []
    for t in range(x.shape[1]):
        full = torch.cat([window, x[:, t, :, None]], dim=2)  # [Bs, C, K]
        y = (full * weight).sum(-1)
        outs.append(y + bias if bias is not None else y)
        window = full[:, :, 1:]
    return torch.stack(outs, dim=1), window


def conv_windows_at(window: torch.Tensor, x: torch.Tensor, at: CapturePoints) -> torch.Tensor:
    """The windows :func:`causal_conv1d_` would leave after each point of ``at``: for ``(b, t)``, the last
    ``K - 1`` inputs of sequence ``b`` up to and including its token ``t``, from ``window`` ``[Bs, C, K-1]``
    (the window before ``x`` ``[Bs, L, C]``; call this before the conv updates it). Returns
    ``[len(at), C, K-1]``: column copies, no arithmetic, so the windows are exact."""
    k1 = window.shape[2]
    out = window.new_empty(len(at), window.shape[1], k1)
    for i, (b, t) in enumerate(at):
        kept = max(0, k1 - (t + 1))  # columns still from the window before the micro-batch
        out[i, :, :kept] = window[b, :, k1 - kept :]
        out[i, :, kept:] = x[b, t + 1 - (k1 - kept) : t + 1].t()
    return out


def conv_windows_at_ref(window: torch.Tensor, x: torch.Tensor, at: CapturePoints) -> torch.Tensor:
    """Token-by-token twin of :func:`conv_windows_at`: shift the window one input at a time."""
    after = []
    for t in range(x.shape[1]):
        window = torch.cat([window, x[:, t, :, None]], dim=2)[:, :, 1:]
        after.append(window)
    return torch.stack([after[t][b] for b, t in at]) if at else window.new_empty(0, *window.shape[1:])
