"""What the hybrid models (LFM2, Nemotron-H) share: the memory context their forward reads
(:class:`HybridStates`), NeoX RoPE, and the attention block with its matrices held as rsmem's other models
hold theirs (:class:`~rsmem.models.step.packed.HeldMatrices`: ``[in, out]``, float32 ones with oneDNN
twins, so
one-row products stream the ``[out, in]`` rows on every core and several rows use the packed copy).

q, k and v are one product (``wqkv``); after :meth:`Attention.hold` ``wq``, ``wk``, ``wv`` and ``wo`` are
``[out, in]`` views of the held matrices (no second copy).
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rsmem.batch.batch import UBatch
from rsmem.models.ops.norm import rms_norm
from rsmem.models.protocol import StateAccess
from rsmem.models.step import small_rows
from rsmem.models.step.fused import RowsOperand, SmallRows, matmul_rows
from rsmem.models.step.packed import HeldMatrices

__all__ = [
    "Attention", "HeldMatrices", "HybridStates", "RopeTables", "hold_all", "many_head", "many_operand",
    "rope_neox", "rope_tables",
]  # fmt: skip

RopeTables = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [n, 1, n_rot / 2]


class HybridStates(StateAccess, Protocol):
    """The memory context as a hybrid model's forward sees it (``HybridMemoryContext``)."""

    def attention(
        self,
        il: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        ubatch: UBatch | None = None,
    ) -> torch.Tensor:
        """Store ``k``, ``v`` ``[n_tokens, n_head_kv, d]`` of ``ubatch``'s tokens (the micro-batch the forward
        runs: a column slice of the placed one when the Context runs it in parts) in layer ``il``'s cache and
        attend with ``q`` ``[n_tokens, n_head, d]``; returns ``[n_tokens, n_head * d]``."""
        ...

    def decode_cells(
        self, ubatch: UBatch | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """For a C++ decode step over the placed micro-batch: each token's KV row to write, its visible rows
        and their validity; None where the step must take the Python attention."""
        ...

    def layer_rows(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``il``'s keys and values as flat rows (views)."""
        ...


def hold_all(held: HeldMatrices, weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Each ``[out, in]`` matrix of ``weights`` held by ``held``; float32 ones held as views of copies on
    transparent huge pages, one arena for all (:meth:`HeldMatrices.on_huge_pages`)."""
    return [held.hold(w) for w in held.on_huge_pages(weights)]


def hold_model(
    held: HeldMatrices,
    embedding: torch.Tensor,
    lm_head: torch.Tensor | None,
    per_layer: Sequence[Sequence[torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, list[list[torch.Tensor]]]:
    """A hybrid's head and its layers' matrices held in one :func:`hold_all`: ``(embedding, lm_head [in,
    out], each layer's held matrices)``. ``lm_head`` None: tied to the float32 ``embedding``, which then
    becomes a view of the held head where that is float32 and contiguous (one copy, on huge pages)."""
    head_out_in = embedding if lm_head is None else lm_head
    matrices = hold_all(held, [head_out_in, *(m for ms in per_layer for m in ms)])
    head, rest = matrices[0], iter(matrices[1:])
    if lm_head is None and head.t().is_contiguous() and head.dtype == torch.float32:
        embedding = head.t()
    return embedding, head, [[next(rest) for _ in ms] for ms in per_layer]


def many_operand(held: HeldMatrices, weight_t: torch.Tensor) -> RowsOperand:
    """A held ``[in, out]`` matrix as several sequences' products take it
    (:func:`~rsmem.models.step.small_rows.many_operand`)."""
    return small_rows.many_operand(weight_t, held.packed.twin(weight_t))


def one_operand(held: HeldMatrices, weight_t: torch.Tensor) -> SmallRows | torch.Tensor:
    """A held ``[in, out]`` matrix as one sequence's products take it
    (:func:`~rsmem.models.step.small_rows.one_operand`)."""
    return small_rows.one_operand(weight_t, held.packed.twin(weight_t))


def many_head(held: HeldMatrices, rows: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """The logits of several sequences' normed ``rows`` ``[n, d_model]``: the held head (``[in, out]``)
    through :func:`many_operand` when it has a packed twin (the head is a quarter of a 130M model's
    weights, and at a few rows the few-row kernel streams it faster than the packed twin), else
    :meth:`HeldMatrices.linear`."""
    if held.packed.twin(lm_head) is None:
        return held.linear(rows, lm_head)
    return matmul_rows(rows, many_operand(held, lm_head))


def rope_tables(pos: torch.Tensor, base: float, n_rot: int) -> RopeTables:
    """cos and sin of NeoX RoPE's angles for positions ``pos`` ``[n]``: ``[n, 1, n_rot / 2]`` each (angles
    in float64, as ggml computes them, then float32)."""
    half = n_rot // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / n_rot)
    angle = (pos.to(torch.float64)[:, None] * inv_freq[None, :]).to(torch.float32)  # [n, half]
    return angle.cos()[:, None, :], angle.sin()[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first ``2 * cos.shape[-1]`` channels of each head of ``x`` ``[n, H, D]``:
    channel ``i`` pairs with ``i + n_rot / 2`` (ggml's ``LLAMA_ROPE_TYPE_NEOX``)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half : 2 * half], x[..., 2 * half :]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


def rope_neox(x: torch.Tensor, pos: torch.Tensor, base: float, n_rot: int) -> torch.Tensor:
    """NeoX-style rotary embedding of the first ``n_rot`` channels of each head: ``x`` ``[n, H, D]``,
    ``pos`` ``[n]``."""
    return apply_rope(x, *rope_tables(pos, base, n_rot))


@dataclass(slots=True)
class Attention:
    """One attention block's weights (``[out, in]`` as loaded) and shape; norms and RoPE are optional.
    :meth:`set_held` must run before :meth:`forward` (the models do it)."""

    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    n_head: int
    n_head_kv: int
    head_dim: int
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    rope_base: float = 0.0  # 0: no RoPE
    n_rot: int = 0
    wqkv_t: torch.Tensor | None = None  # [in, out] held (HeldMatrices)
    wo_t: torch.Tensor | None = None
    held: HeldMatrices | None = None

    def matrices(self) -> list[torch.Tensor]:
        """What :meth:`set_held` takes held: q, k and v as one ``[out, in]`` matrix, then o."""
        return [torch.cat([self.wq, self.wk, self.wv]).float(), self.wo.float()]

    def set_held(self, held: HeldMatrices, wqkv_t: torch.Tensor, wo_t: torch.Tensor) -> None:
        """Use the held (``[in, out]``) :meth:`matrices`; the ``w*`` fields become views of them."""
        q, k = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        self.wqkv_t, self.wo_t = wqkv_t, wo_t
        self.wq, self.wk, self.wv = self.wqkv_t.t().split([q, k, k])
        self.wo = self.wo_t.t()
        self.held = held
        if self.q_norm is not None:
            self.q_norm = self.q_norm.float()
        if self.k_norm is not None:
            self.k_norm = self.k_norm.float()

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    def qkv(
        self, flat: torch.Tensor, rope: RopeTables | None, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q ``[n, H, D]``, k and v ``[n, Hkv, D]`` of the normed rows ``flat`` ``[n, d_model]`` (q/k norms
        and RoPE applied)."""
        assert self.held is not None and self.wqkv_t is not None, "Attention.set_held() was not called"
        q_n, k_n = self.n_head * self.head_dim, self.n_head_kv * self.head_dim
        q, k, v = self.held.linear(flat, self.wqkv_t).split([q_n, k_n, k_n], dim=-1)
        q = q.reshape(-1, self.n_head, self.head_dim)
        k = k.reshape(-1, self.n_head_kv, self.head_dim)
        v = v.reshape(-1, self.n_head_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        if self.rope_base and rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        return q, k, v

    def forward(
        self,
        il: int,
        h: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        eps: float,
        rope: RopeTables | None = None,
    ) -> torch.Tensor:
        """``h`` ``[Bs, L, d_model]`` (normed input) of ``ubatch``'s tokens -> ``[Bs, L, d_model]``.
        ``rope``: the micro-batch's tables (:meth:`rope_for`), computed here when None."""
        assert self.held is not None and self.wo_t is not None, "Attention.set_held() was not called"
        n_seqs, n_tokens, _ = h.shape
        if rope is None and self.rope_base:
            rope = self.rope_for(ubatch)
        q, k, v = self.qkv(h.reshape(n_seqs * n_tokens, -1), rope, eps)
        out = states.attention(il, q, k, v, self.scale, ubatch)
        return self.held.linear(out, self.wo_t).view(n_seqs, n_tokens, -1)

    def rope_for(self, ubatch: UBatch) -> RopeTables | None:
        """RoPE tables for the micro-batch's positions (None without RoPE)."""
        if not self.rope_base:
            return None
        return rope_tables(torch.tensor(ubatch.pos, dtype=torch.long), self.rope_base, self.n_rot)

    def k_shift(self, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Stored keys ``[n, n_head_kv * head_dim]`` moved by ``delta`` positions."""
        if not self.rope_base:
            return rows
        heads = rows.view(-1, self.n_head_kv, self.head_dim)
        return rope_neox(heads, delta, self.rope_base, self.n_rot).reshape(rows.shape)


def warm_up_decode(model: Any) -> float:
    """Run a one-sequence and a two-sequence decode step of ``model`` on scratch memories, so that its
    compiled steps are compiled now rather than at a request's first token; the seconds it took."""
    from rsmem.batch.batch import Batch  # here: rsmem.context imports the models package
    from rsmem.context import Context

    started = time.perf_counter()
    Context(model, n_ctx=256).decode(Batch([1]))
    Context(model, n_seq_max=2, n_ctx=512).decode(Batch([1, 1], seq_ids=[[0], [1]]))
    return time.perf_counter() - started
