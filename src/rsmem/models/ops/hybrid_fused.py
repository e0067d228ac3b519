"""One-token blocks of the hybrid models (LFM2, Nemotron-H) written for ``torch.compile`` to fuse, as
:mod:`rsmem.models.ops.fused` does for Mamba (see there for why they look the way they do).

A decode step of one sequence runs each layer as one compiled call; an attention layer is two, around the
KV cache's store and attention, which run eagerly (their shapes change every step). ``*_one`` blocks take
matrices as ``[out, in]`` rows and use :func:`~rsmem.models.ops.fused.gemv`; the ``*_glue_`` functions
are what lies between the packed products when several sequences decode (the products themselves run
eagerly through oneDNN). ``x`` is the residual stream ``[Bs, d_model]``; ``window`` ``[Bs, C, K-1]`` is
updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.models.ops.fused import gemv, head_one
from rsmem.models.ops.norm import rms_norm


def swiglu_one(
    x: torch.Tensor, ffn_norm: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, eps: float
) -> torch.Tensor:
    """``x + swiglu(rms_norm(x))`` with ``gate_up`` ``[2 * d_ff, d]`` (gate rows first)."""
    g, u = gemv(rms_norm(x, ffn_norm, eps), gate_up).chunk(2, dim=-1)
    return x + gemv(F.silu(g) * u, down)


def short_conv_mix_(bcx: torch.Tensor, window: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """LFM2's short convolution between its projections, one token: ``bcx`` ``[Bs, 3d]`` (``b, c, x``),
    ``window`` ``[Bs, d, L-1]`` shifted in place; returns ``c * conv(b * x)`` ``[Bs, d]``."""
    b, c, xx = bcx.chunk(3, dim=-1)
    bx = (b * xx).unsqueeze(-1)  # [Bs, d, 1]
    full = torch.cat([window, bx], dim=-1)  # [Bs, d, L]
    y = (full * conv).sum(-1)
    window.copy_(full[:, :, 1:])
    return c * y


def lfm2_conv_one_(
    x: torch.Tensor,
    attn_norm: torch.Tensor,
    conv_in: torch.Tensor,
    conv: torch.Tensor,
    conv_out: torch.Tensor,
    ffn_norm: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    window: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """A whole LFM2 convolution layer (operator and SwiGLU) for one sequence's token; the new ``x``."""
    bcx = gemv(rms_norm(x, attn_norm, eps), conv_in)
    x = x + gemv(short_conv_mix_(bcx, window, conv), conv_out)
    return swiglu_one(x, ffn_norm, gate_up, down, eps)


def attn_in_one(
    x: torch.Tensor,
    norm: torch.Tensor,
    wqkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    n_head: int,
    n_head_kv: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer up to the KV cache, one token: q ``[1, H, D]``, k and v ``[1, Hkv, D]`` (q/k
    RMS norms per head and NeoX RoPE with ``cos``/``sin`` ``[1, 1, n_rot / 2]`` when given)."""
    qkv = gemv(rms_norm(x, norm, eps), wqkv)
    head_dim = qkv.shape[-1] // (n_head + 2 * n_head_kv)
    q, k, v = qkv.split([n_head * head_dim, n_head_kv * head_dim, n_head_kv * head_dim], dim=-1)
    q, k, v = q.view(-1, n_head, head_dim), k.view(-1, n_head_kv, head_dim), v.view(-1, n_head_kv, head_dim)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    if cos is not None and sin is not None:
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
    return q, k, v


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def lfm2_attn_out_one(
    x: torch.Tensor,
    o: torch.Tensor,
    wo: torch.Tensor,
    ffn_norm: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """The rest of an LFM2 attention layer after attention (``o`` ``[1, H * D]``): out-projection,
    residual, SwiGLU; the new ``x``."""
    return swiglu_one(x + gemv(o, wo), ffn_norm, gate_up, down, eps)


def attn_out_one(x: torch.Tensor, o: torch.Tensor, wo: torch.Tensor) -> torch.Tensor:
    """Nemotron-H's attention layer after attention: ``x + o @ wo.T``."""
    return x + gemv(o, wo)


def relu2_mlp_one(
    x: torch.Tensor, norm: torch.Tensor, up: torch.Tensor, down: torch.Tensor, eps: float
) -> torch.Tensor:
    """Nemotron-H's MLP layer for one token: ``x + relu(rms_norm(x) @ up.T)^2 @ down.T``."""
    return x + gemv(torch.relu(gemv(rms_norm(x, norm, eps), up)).square(), down)


# ------------------------------------------------------------------------------ chains of blocks


@dataclass(frozen=True, slots=True)
class Block:
    """One ``*_one`` block as a chain step: ``fn(x, *tensors, *consts) -> x`` over ``n`` tensors, of which
    the offsets ``mutated`` are written in place (state rows)."""

    fn: Callable[..., torch.Tensor]
    n: int
    consts: tuple[float | int, ...] = ()
    mutated: tuple[int, ...] = ()


ATTN_IN_TENSORS = 6  # norm, wqkv, q_norm, k_norm, cos, sin (then n_head, n_head_kv, eps)
HEAD_TENSORS = 2  # norm_f, lm_head (then eps)


def chain(
    blocks: tuple[Block, ...], tail: str, tail_consts: tuple[float | int, ...]
) -> Callable[..., object]:
    """One function running ``blocks`` in order on ``(x, *flat)`` (each block's tensors in turn), then its
    ``tail``: ``"attn_in"`` returns ``(x, q, k, v)`` (:func:`attn_in_one` on the next ``ATTN_IN_TENSORS``
    tensors), ``"head"`` the logits (:func:`~rsmem.models.ops.fused.head_one`). Compiled, a decode step of
    one sequence is one call per stretch between attention layers."""

    def chain_one(x: torch.Tensor, *flat: Any) -> object:  # tensors, None for absent norms
        i = 0
        for b in blocks:
            x = b.fn(x, *flat[i : i + b.n], *b.consts)
            i += b.n
        rest = flat[i:]
        if tail == "head":
            return head_one(x, rest[0], rest[1], *tail_consts)
        return (x, *attn_in_one(x, *rest, *tail_consts))

    return chain_one
