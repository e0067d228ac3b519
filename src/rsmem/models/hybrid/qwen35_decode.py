"""Qwen3.5's decode step (one token of each sequence) as compiled chains, as LFM2's and Nemotron-H's
(:mod:`rsmem.models.hybrid.chains`): one function per stretch between attention layers, the KV cache's
store and attention eagerly between them.

A stretch is: the end of the attention layer before it (``x + (o * sigmoid(gate)) @ wo^T``, then its
SwiGLU), the gated delta net layers (operator and SwiGLU each), then the next attention layer up to the KV
cache (q/k/v, the gate, per-head norms, partial NeoX RoPE), or the final norm and head. With attention every
fourth layer that is 7 calls a token, 3 compilations. The delta rule of one token is written so that the
new state is not read back (:func:`delta_step_`): ``o = S' q = e^g S q + (k . q) delta``.

Products are :func:`~rsmem.models.step.fused.gemv` over ``[out, in]`` rows for one sequence (static shapes)
and :func:`~rsmem.models.step.fused.matmul_rows` for several (the few-row kernel, oneDNN's packed
twins beyond 16 rows; the batch dimension dynamic). Each compiled function is checked before first use with
an eager fallback (:class:`~rsmem.models.step.compiled.CompiledStep`); :func:`stretch` is correct eagerly too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.models.ops.delta_net import l2_norm
from rsmem.models.ops.norm import rms_norm
from rsmem.models.step.compiled import GLUE_MIN_CHUNK, CompiledStep
from rsmem.models.step.fused import Product, gemv, matmul_rows
from rsmem.models.step.hybrid_fused import swiglu_

__all__ = ["DELTA_TENSORS", "AttnIn", "DeltaDims", "QwenChains", "delta_step_", "stretch"]

DELTA_TENSORS = 12  # attn_norm, w_in, conv, dt_bias, a, norm, w_out, post_norm, gate_up, down, window, state
OUT_TENSORS = 6  # o, gate, wo, post_norm, gate_up, down
OUT_BATCH = (0, 1)  # o and gate: one row a sequence
ATTN_IN_TENSORS = 6  # attn_norm, wqkv, q_norm, k_norm, cos, sin
ATTN_IN_BATCH = (4, 5)  # cos, sin
DELTA_MUTATED = (10, 11)  # window, state


@dataclass(frozen=True, slots=True)
class DeltaDims:
    """The shapes a chain is compiled for: delta net heads and attention heads, and the norms' eps."""

    nk: int
    nv: int
    dk: int
    dv: int
    n_head: int
    n_head_kv: int
    head_dim: int
    eps: float


def delta_step_(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """:func:`~rsmem.models.ops.delta_net.delta_rule_step` with the output from the old state (``q``, ``k``
    ``[Bs, H, dk]``, ``v`` ``[Bs, H, dv]``, ``g``, ``beta`` ``[Bs, H]``, ``state`` ``[Bs, H, dv, dk]``
    written in place): compiled, the state is read in one pass for ``S k`` and ``S q`` and written in the
    next."""
    decay = g.exp().unsqueeze(-1)  # [Bs, H, 1]
    kq = (k * q).sum(-1, keepdim=True)  # [Bs, H, 1]
    s_k = (state * k.unsqueeze(-2)).sum(-1) * decay  # e^g S k: [Bs, H, dv]
    s_q = (state * q.unsqueeze(-2)).sum(-1) * decay
    delta = (v - s_k) * beta.unsqueeze(-1)
    state.copy_(state * decay.unsqueeze(-1) + delta.unsqueeze(-1) * k.unsqueeze(-2))
    return s_q + kq * delta


def delta_layer_(
    product: Product,
    x: torch.Tensor,
    attn_norm: torch.Tensor,
    w_in: Any,
    conv: torch.Tensor,
    dt_bias: torch.Tensor,
    a: torch.Tensor,
    norm: torch.Tensor,
    w_out: Any,
    post_norm: torch.Tensor,
    gate_up: Any,
    down: Any,
    window: torch.Tensor,
    state: torch.Tensor,
    d: DeltaDims,
) -> torch.Tensor:
    """A whole gated delta net layer for one token of each sequence (``x`` ``[Bs, d_model]``; ``window``
    ``[Bs, conv_dim, K-1]`` and ``state`` ``[Bs, nv, dv, dk]`` written in place); the new ``x``."""
    key, val = d.nk * d.dk, d.nv * d.dv
    proj = product(rms_norm(x, attn_norm, d.eps), w_in)
    mixed, z, beta, alpha = proj.split([2 * key + val, val, d.nv, d.nv], dim=-1)
    full = torch.cat([window, mixed.unsqueeze(-1)], dim=-1)  # [Bs, conv_dim, K]
    c = F.silu((full * conv).sum(-1))
    window.copy_(full[:, :, 1:])
    q, k, v = c.split([key, key, val], dim=-1)
    q = l2_norm(q.reshape(-1, d.nk, d.dk), d.eps) * (d.dk**-0.5)
    k = l2_norm(k.reshape(-1, d.nk, d.dk), d.eps)
    if d.nv != d.nk:  # tiled: value head h reads key head h % nk
        q, k = q.repeat(1, d.nv // d.nk, 1), k.repeat(1, d.nv // d.nk, 1)
    g = F.softplus(alpha + dt_bias) * a
    o = delta_step_(q, k, v.reshape(-1, d.nv, d.dv), g, torch.sigmoid(beta), state)
    o = rms_norm(o, norm, d.eps) * F.silu(z.reshape(-1, d.nv, d.dv))
    x = x + product(o.reshape(-1, val), w_out)
    return swiglu_(product, x, post_norm, gate_up, down, d.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def attn_in_(
    product: Product,
    x: torch.Tensor,
    norm: torch.Tensor,
    wqkv: Any,
    q_norm: torch.Tensor,
    k_norm: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    d: DeltaDims,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A gated attention layer up to the KV cache: q ``[Bs, H, D]``, k, v ``[Bs, Hkv, D]`` and the gate
    ``[Bs, H * D]``."""
    nh, nkv, hd = d.n_head, d.n_head_kv, d.head_dim
    qg, k, v = product(rms_norm(x, norm, d.eps), wqkv).split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
    q, gate = qg.reshape(-1, nh, 2 * hd).split([hd, hd], dim=-1)
    q = _rope(rms_norm(q, q_norm, d.eps), cos, sin)
    k = _rope(rms_norm(k.reshape(-1, nkv, hd), k_norm, d.eps), cos, sin)
    return q, k, v.reshape(-1, nkv, hd), gate.reshape(-1, nh * hd)


def attn_out_(
    product: Product,
    x: torch.Tensor,
    o: torch.Tensor,
    gate: torch.Tensor,
    wo: Any,
    post_norm: torch.Tensor,
    gate_up: Any,
    down: Any,
    d: DeltaDims,
) -> torch.Tensor:
    """The attention layer after attention (``o`` ``[Bs, H * D]``): gate, out-projection, SwiGLU."""
    x = x + product(o * torch.sigmoid(gate), wo)
    return swiglu_(product, x, post_norm, gate_up, down, d.eps)


def stretch(
    product: Product, dims: DeltaDims, has_out: bool, n_delta: int, tail: str
) -> Callable[..., object]:
    """One stretch on ``(x, *flat)``: an attention layer's end (``OUT_TENSORS``) when ``has_out``,
    ``n_delta`` delta net layers (``DELTA_TENSORS`` each), then ``tail``: ``"attn_in"`` returns ``(x, q, k,
    v, gate)`` (``ATTN_IN_TENSORS``), ``"head"`` the logits (norm_f, head), ``"norm"`` the normed rows."""

    # typed loosely: each takes its tensors as a slice of the flat arguments
    out_fn: Callable[..., torch.Tensor] = attn_out_
    delta_fn: Callable[..., torch.Tensor] = delta_layer_
    in_fn: Callable[..., tuple[torch.Tensor, ...]] = attn_in_

    def stretch_step(x: torch.Tensor, *flat: Any) -> object:
        i = 0
        if has_out:
            x = out_fn(product, x, *flat[:OUT_TENSORS], dims)
            i = OUT_TENSORS
        for _ in range(n_delta):
            x = delta_fn(product, x, *flat[i : i + DELTA_TENSORS], dims)
            i += DELTA_TENSORS
        rest = flat[i:]
        if tail == "head":
            return product(rms_norm(x, rest[0], dims.eps), rest[1])
        if tail == "norm":
            return rms_norm(x, rest[0], dims.eps)
        return (x, *in_fn(product, x, *rest, dims))

    return stretch_step


@dataclass(slots=True)
class AttnIn:
    """An attention layer in a step: its ``attn_in`` tensors, then ``(wo, post_norm, gate_up, down)``."""

    il: int
    attn_in: tuple[Any, ...]
    out: tuple[Any, ...]


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


class QwenChains:
    """The compiled stretches of one model, for one sequence or (``many``) one token of several."""

    def __init__(self, dims: DeltaDims, many: bool, compiled: bool = True) -> None:
        self.dims, self.many, self.compiled = dims, many, compiled
        self._steps: dict[tuple[object, ...], Callable[..., object]] = {}

    def _step(self, has_out: bool, n_delta: int, tail: str) -> Callable[..., object]:
        key = (has_out, n_delta, tail)
        found = self._steps.get(key)
        if found is None:
            fn = stretch(matmul_rows if self.many else gemv, self.dims, has_out, n_delta, tail)
            at = 1 + (OUT_TENSORS if has_out else 0)
            mutated = [at + n * DELTA_TENSORS + m for n in range(n_delta) for m in DELTA_MUTATED]
            batch = [0, *(1 + b for b in OUT_BATCH if has_out), *mutated]
            if tail == "attn_in":
                batch += [at + n_delta * DELTA_TENSORS + b for b in ATTN_IN_BATCH]
            if self.compiled:
                found = CompiledStep(
                    fn,
                    batch_args=tuple(batch) if self.many else (),
                    mutated=tuple(mutated),
                    options={"cpp.min_chunk_size": GLUE_MIN_CHUNK},  # the glue on one thread
                )
            else:
                found = fn
            self._steps[key] = found
        return found

    @property
    def steps(self) -> list[Callable[..., object]]:
        return list(self._steps.values())

    def run(
        self,
        x: torch.Tensor,
        layers: Sequence[tuple[Any, ...] | AttnIn],
        tail: str,
        tail_tensors: tuple[Any, ...],
        attend: Attend,
    ) -> torch.Tensor:
        """The layers (a delta net layer's ``DELTA_TENSORS`` tensors, or an :class:`AttnIn`) on the residual
        ``x`` ``[Bs, d_model]``, then ``tail``; ``attend(il, q, k, v)`` is the KV cache's part."""
        out: tuple[Any, ...] | None = None
        flat: list[Any] = []
        n_delta = 0
        for layer in layers:
            if not isinstance(layer, AttnIn):
                flat += layer
                n_delta += 1
                continue
            args = (x, *(out or ()), *flat, *layer.attn_in)
            res = self._step(out is not None, n_delta, "attn_in")(*args)
            assert isinstance(res, tuple)
            x, q, k, v, gate = res
            out = (attend(layer.il, q, k, v), gate, *layer.out)
            flat, n_delta = [], 0
        args = (x, *(out or ()), *flat, *tail_tensors)
        result = self._step(out is not None, n_delta, tail)(*args)
        assert isinstance(result, torch.Tensor)
        return result
