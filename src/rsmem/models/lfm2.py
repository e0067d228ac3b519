"""LFM2 (Liquid AI) on rsmem's hybrid memory, computed as llama.cpp's ``lfm2`` graph.

Per layer: ``x += op(rms_norm(x))``, then ``x += swiglu(rms_norm(x))``. The operator is either a short
convolution (``in_proj`` gives ``b, c, x``; ``y = c * conv(b * x)``; the state is only the conv window of
``b * x``, ``[n_embd, L_cache - 1]``, llama.cpp's ``r`` row; ``s`` is empty) or grouped-query attention with
RMS-normed q and k per head and NeoX RoPE over the whole head, its keys and values in the KV cache. After
the last layer: RMS norm (``token_embd_norm`` in the GGUF) and the LM head.

Also here, for the hybrids that share them: :class:`HybridStates` (what a hybrid model's forward reads),
:func:`rope_neox` and :class:`Attention` (the q/k/v/o block). Eager float32 paths; no compiled steps yet.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.ops.common import output_rows
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.norm import rms_norm
from rsmem.models.protocol import StateAccess

if TYPE_CHECKING:
    from tokenizers import Tokenizer


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


def rope_neox(x: torch.Tensor, pos: torch.Tensor, base: float, n_rot: int) -> torch.Tensor:
    """NeoX-style rotary embedding of the first ``n_rot`` channels of each head: ``x`` ``[n, H, D]``,
    ``pos`` ``[n]``; channel ``i`` pairs with ``i + n_rot / 2`` (ggml's ``LLAMA_ROPE_TYPE_NEOX``)."""
    half = n_rot // 2
    inv_freq = base ** (-torch.arange(half, dtype=torch.float64) * 2 / n_rot)
    angle = (pos.to(torch.float64)[:, None] * inv_freq[None, :]).to(torch.float32)  # [n, half]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2, rest = x[..., :half], x[..., half:n_rot], x[..., n_rot:]
    return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos, rest], dim=-1)


@dataclass(slots=True)
class Attention:
    """One attention block's weights (``[out, in]``) and shape; norms and RoPE are optional."""

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

    def forward(
        self, il: int, h: torch.Tensor, ubatch: UBatch, states: HybridStates, eps: float
    ) -> torch.Tensor:
        """``h`` ``[Bs, L, d_model]`` (normed input) of ``ubatch``'s tokens -> ``[Bs, L, d_model]``."""
        pos = torch.tensor(ubatch.pos, dtype=torch.long)
        n_seqs, n_tokens, _ = h.shape
        flat = h.reshape(n_seqs * n_tokens, -1)
        q = F.linear(flat, self.wq).view(-1, self.n_head, self.head_dim)
        k = F.linear(flat, self.wk).view(-1, self.n_head_kv, self.head_dim)
        v = F.linear(flat, self.wv).view(-1, self.n_head_kv, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = rms_norm(q, self.q_norm, eps), rms_norm(k, self.k_norm, eps)
        if self.rope_base:
            q, k = (
                rope_neox(q, pos, self.rope_base, self.n_rot),
                rope_neox(k, pos, self.rope_base, self.n_rot),
            )
        out = states.attention(il, q, k, v, 1.0 / math.sqrt(self.head_dim), ubatch)
        return F.linear(out, self.wo).view(n_seqs, n_tokens, -1)

    def k_shift(self, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Stored keys ``[n, n_head_kv * head_dim]`` moved by ``delta`` positions."""
        if not self.rope_base:
            return rows
        heads = rows.view(-1, self.n_head_kv, self.head_dim)
        return rope_neox(heads, delta, self.rope_base, self.n_rot).reshape(rows.shape)


@dataclass(frozen=True, slots=True)
class Lfm2Config:
    d_model: int
    n_layer: int
    n_vocab: int
    d_ff: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer; 0 marks a short-convolution layer
    l_cache: int = 3
    rope_base: float = 1_000_000.0
    eps: float = 1e-5
    n_ctx_train: int = 128_000

    def __post_init__(self) -> None:
        if len(self.n_head_kv) != self.n_layer or self.d_model % self.n_head or self.l_cache < 2:
            raise ValueError(f"inconsistent LFM2 hyperparameters: {self}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_head


@dataclass(slots=True)
class Lfm2Layer:
    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_gate: torch.Tensor  # [d_ff, d_model]
    ffn_up: torch.Tensor
    ffn_down: torch.Tensor  # [d_model, d_ff]
    attention: Attention | None = None
    conv: torch.Tensor | None = None  # [d_model, l_cache]
    conv_in: torch.Tensor | None = None  # [3 * d_model, d_model]: b, c, x
    conv_out: torch.Tensor | None = None  # [d_model, d_model]


@dataclass(slots=True)
class Lfm2Weights:
    embedding: torch.Tensor
    layers: list[Lfm2Layer]
    norm_f: torch.Tensor
    lm_head: torch.Tensor


def swiglu(h: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(h, gate)) * F.linear(h, up), down)


class Lfm2Model:
    """An LFM2 language model for a :class:`~rsmem.memory.hybrid.HybridMemory` (float32, eager)."""

    arch = "lfm2"
    compile_decode = False

    def __init__(self, config: Lfm2Config, weights: Lfm2Weights) -> None:
        self.config = config
        self.n_vocab = config.n_vocab
        self.n_layer = config.n_layer
        self.n_embd_r = (config.l_cache - 1) * config.d_model
        self.n_embd_s = 0
        self.tokenizer: Tokenizer | None = None
        f32 = torch.float32
        self.embedding = weights.embedding.to(f32).contiguous()
        self.norm_f = weights.norm_f.to(f32)
        self.lm_head = weights.lm_head.to(f32).contiguous()
        self.layers = weights.layers
        self.kv_layers: Mapping[int, tuple[int, int]] = {
            il: (n * config.head_dim, n * config.head_dim) for il, n in enumerate(config.n_head_kv) if n
        }

    def is_recurrent_layer(self, il: int) -> bool:
        return self.config.n_head_kv[il] == 0

    def k_shift(self, il: int, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        attention = self.layers[il].attention
        return rows if attention is None else attention.k_shift(rows, delta)

    def set_compile(self, setting: object) -> bool:
        return False

    def warm_up(self) -> float:
        return 0.0

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; ``states`` must be a hybrid memory's context."""
        hybrid = cast(HybridStates, states)  # RecurrentModel's signature; attention needs HybridStates
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        n_seqs = tokens.shape[0]
        x = self.embedding[tokens]  # [Bs, L, d_model]
        for il, ly in enumerate(self.layers):
            h = rms_norm(x, ly.attn_norm, cfg.eps)
            if ly.attention is not None:
                x = x + ly.attention.forward(il, h, ubatch, hybrid, cfg.eps)
            else:
                x = x + self.short_conv(il, ly, h, hybrid, n_seqs)
            x = x + swiglu(rms_norm(x, ly.ffn_norm, cfg.eps), ly.ffn_gate, ly.ffn_up, ly.ffn_down)
        x = output_rows(x, ubatch.output_rows())
        return F.linear(rms_norm(x, self.norm_f, cfg.eps), self.lm_head)

    def short_conv(
        self, il: int, ly: Lfm2Layer, h: torch.Tensor, states: HybridStates, n_seqs: int
    ) -> torch.Tensor:
        assert ly.conv is not None and ly.conv_in is not None and ly.conv_out is not None
        r, s = states.read_states(il)
        window = r.view(n_seqs, self.config.d_model, self.config.l_cache - 1)
        work = window if window.dtype == torch.float32 else window.float()
        b, c, xx = F.linear(h, ly.conv_in).chunk(3, dim=-1)
        y = c * causal_conv1d_(b * xx, work, ly.conv, None)
        states.write_states(il, work, s)
        return F.linear(y, ly.conv_out)
