"""Decode blocks of the hybrid models (LFM2, Nemotron-H) written for ``torch.compile`` to fuse, as
:mod:`rsmem.models.step.fused` does for Mamba (see there for why they look the way they do).

Each block takes its products as ``product``: :func:`~rsmem.models.step.fused.gemv` for one sequence's
token (``*_one``: matrices as ``[out, in]`` rows, a fused reduction streaming them) or
:func:`~rsmem.models.step.fused.matmul_rows` for one token of each of several sequences (``*_many``:
matrices as :func:`~rsmem.models.step.small_rows.rows_operand` gives them: the C++ few-row kernel up to 16
rows, oneDNN's packed twin beyond, one extern call inside the compiled code). A decode step chains the
blocks between attention layers into one compiled call (:func:`chain`); the KV cache's store and attention
run eagerly between them (their shapes change every step). ``x`` is the residual stream ``[Bs, d_model]``;
``window`` ``[Bs, C, K-1]`` is updated in place.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.models.ops.norm import rms_norm
from rsmem.models.step.fused import Product, gemv, matmul_rows


def swiglu_(
    product: Product, x: torch.Tensor, ffn_norm: torch.Tensor, gate_up: Any, down: Any, eps: float
) -> torch.Tensor:
    """``x + swiglu(rms_norm(x))`` with ``gate_up`` ``[2 * d_ff, d]`` (gate rows first)."""
    g, u = product(rms_norm(x, ffn_norm, eps), gate_up).chunk(2, dim=-1)
    return x + product(F.silu(g) * u, down)


def short_conv_mix_(bcx: torch.Tensor, window: torch.Tensor, conv: torch.Tensor) -> torch.Tensor:
    """LFM2's short convolution between its projections, one token: ``bcx`` ``[Bs, 3d]`` (``b, c, x``),
    ``window`` ``[Bs, d, L-1]`` shifted in place; returns ``c * conv(b * x)`` ``[Bs, d]``."""
    b, c, xx = bcx.chunk(3, dim=-1)
    bx = (b * xx).unsqueeze(-1)  # [Bs, d, 1]
    full = torch.cat([window, bx], dim=-1)  # [Bs, d, L]
    y = (full * conv).sum(-1)
    window.copy_(full[:, :, 1:])
    return c * y


def lfm2_conv_(
    product: Product,
    x: torch.Tensor,
    attn_norm: torch.Tensor,
    conv_in: Any,
    conv: torch.Tensor,
    conv_out: Any,
    ffn_norm: torch.Tensor,
    gate_up: Any,
    down: Any,
    window: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """A whole LFM2 convolution layer (operator and SwiGLU); the new ``x``."""
    bcx = product(rms_norm(x, attn_norm, eps), conv_in)
    x = x + product(short_conv_mix_(bcx, window, conv), conv_out)
    return swiglu_(product, x, ffn_norm, gate_up, down, eps)


def attn_in_(
    product: Product,
    x: torch.Tensor,
    norm: torch.Tensor,
    wqkv: Any,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    n_head: int,
    n_head_kv: int,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An attention layer up to the KV cache: q ``[Bs, H, D]``, k and v ``[Bs, Hkv, D]`` (q/k RMS norms
    per head and NeoX RoPE with ``cos``/``sin`` ``[Bs, 1, n_rot / 2]`` when given)."""
    qkv = product(rms_norm(x, norm, eps), wqkv)
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


def lfm2_attn_out_(
    product: Product,
    x: torch.Tensor,
    o: torch.Tensor,
    wo: Any,
    ffn_norm: torch.Tensor,
    gate_up: Any,
    down: Any,
    eps: float,
) -> torch.Tensor:
    """The rest of an LFM2 attention layer after attention (``o`` ``[Bs, H * D]``): out-projection,
    residual, SwiGLU; the new ``x``."""
    return swiglu_(product, x + product(o, wo), ffn_norm, gate_up, down, eps)


def attn_out_(product: Product, x: torch.Tensor, o: torch.Tensor, wo: Any) -> torch.Tensor:
    """Nemotron-H's attention layer after attention: ``x + o @ wo.T``."""
    return x + product(o, wo)


def relu2_mlp_(
    product: Product, x: torch.Tensor, norm: torch.Tensor, up: Any, down: Any, eps: float
) -> torch.Tensor:
    """Nemotron-H's MLP layer: ``x + relu(rms_norm(x) @ up.T)^2 @ down.T``."""
    return x + product(torch.relu(product(rms_norm(x, norm, eps), up)).square(), down)


# the blocks for one sequence (gemv) and for several (matmul_rows)
def lfm2_conv_one_(*args: Any) -> torch.Tensor:
    return lfm2_conv_(gemv, *args)


def lfm2_conv_many_(*args: Any) -> torch.Tensor:
    return lfm2_conv_(matmul_rows, *args)


def lfm2_attn_out_one(*args: Any) -> torch.Tensor:
    return lfm2_attn_out_(gemv, *args)


def lfm2_attn_out_many(*args: Any) -> torch.Tensor:
    return lfm2_attn_out_(matmul_rows, *args)


def attn_out_one(*args: Any) -> torch.Tensor:
    return attn_out_(gemv, *args)


def attn_out_many(*args: Any) -> torch.Tensor:
    return attn_out_(matmul_rows, *args)


def relu2_mlp_one(*args: Any) -> torch.Tensor:
    return relu2_mlp_(gemv, *args)


def relu2_mlp_many(*args: Any) -> torch.Tensor:
    return relu2_mlp_(matmul_rows, *args)


# ------------------------------------------------------------------------------ chains of blocks


@dataclass(frozen=True, slots=True)
class Block:
    """One block as a chain step: ``fn(x, *tensors, *consts) -> x`` over ``n`` tensors, of which the
    offsets ``mutated`` are written in place (state rows) and ``batch`` are per-sequence inputs besides
    them (attention's output ``o``): with the residual, the arguments whose dimension 0 is the batch."""

    fn: Callable[..., torch.Tensor]
    n: int
    consts: tuple[float | int, ...] = ()
    mutated: tuple[int, ...] = ()
    batch: tuple[int, ...] = ()


ATTN_IN_TENSORS = 6  # norm, wqkv, q_norm, k_norm, cos, sin (then n_head, n_head_kv, eps)
ATTN_IN_BATCH = (4, 5)  # cos and sin: one row per token
HEAD_TENSORS = 2  # norm_f, lm_head (then eps)
TAILS = ("attn_in", "head", "norm")


def chain(
    blocks: tuple[Block, ...], tail: str, tail_consts: tuple[float | int, ...], product: Product = gemv
) -> Callable[..., object]:
    """One function running ``blocks`` in order on ``(x, *flat)`` (each block's tensors in turn), then its
    ``tail``: ``"attn_in"`` returns ``(x, q, k, v)`` (:func:`attn_in_` on the next ``ATTN_IN_TENSORS``
    tensors), ``"head"`` the logits (final norm and ``product`` with the head: ``HEAD_TENSORS``),
    ``"norm"`` the final norm's rows (its one tensor; the head then runs on the output rows). Compiled, a
    decode step is one call per stretch between attention layers."""
    if tail not in TAILS:
        raise ValueError(f"unknown chain tail {tail!r}")

    def chain_step(x: torch.Tensor, *flat: Any) -> object:  # tensors, None for absent norms
        i = 0
        for b in blocks:
            x = b.fn(x, *flat[i : i + b.n], *b.consts)
            i += b.n
        rest = flat[i:]
        if tail == "head":
            return product(rms_norm(x, rest[0], *tail_consts), rest[1])
        if tail == "norm":
            return rms_norm(x, rest[0], *tail_consts)
        return (x, *attn_in_(product, x, *rest, *tail_consts))

    return chain_step
