"""Qwen3.5 (dense, ``qwen35``; transformers' ``Qwen3_5ForCausalLM``) on rsmem's hybrid memory, computed as
llama.cpp's ``qwen35`` graph.

Per layer: ``x += op(rms_norm(x))``, then ``x += swiglu(rms_norm(x))`` (the second norm is
``post_attention_norm``). The operator is either

- a **gated delta net** (transformers' ``linear_attention``): one product gives the conv input ``q k v``,
  the output gate ``z`` and the per-head ``beta`` and ``alpha``; a causal depthwise convolution (no bias)
  and SiLU over ``q k v``; ``q`` and ``k`` L2-normalised, ``q`` scaled by ``1/sqrt(dk)``, both repeated
  from the key heads to the value heads *tiled* (value head ``h`` reads key head ``h % n_k_heads``: the
  converter reordered the value heads so); ``g = softplus(alpha + dt_bias) * ssm_a``
  (``ssm_a = -exp(A_log)``), ``beta = sigmoid(beta)``; the delta rule (:mod:`rsmem.models.ops.delta_net`);
  ``rms_norm(o) * silu(z)`` per head; the output product. Its memory is llama.cpp's: ``r`` the conv window,
  ``[conv_dim, d_conv - 1]`` channel-major, ``s`` the heads' states ``[H, dv, dk]`` (``dk`` fastest);
- or **gated attention**: the q product gives, per head, ``head_dim`` query values then ``head_dim`` gate
  values; q and k RMS-normed per head, NeoX RoPE over the first ``n_rot`` channels (llama.cpp's interleaved
  M-RoPE, which for text positions, every section reading the same position, is this rotation), attention
  over the KV cache, times ``sigmoid(gate)``, the output product.

Norm weights are llama.cpp's (the converter stores transformers' zero-centred ``w`` as ``1 + w``, except
the delta net's output norm). After the last layer: RMS norm and the LM head. Matrices are held as the other
hybrids hold theirs (:func:`~rsmem.models.hybrid.layers.hold_model`). A decode step (one token of each
sequence) runs as compiled chains between the attention layers when the model compiles
(:mod:`rsmem.models.hybrid.qwen35_decode`, :mod:`rsmem.models.step.compiled`'s policy and checked
fallback); prefill is
eager.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.hybrid.base import HybridModelBase, Operand, StateFills
from rsmem.models.hybrid.chains import Attend
from rsmem.models.hybrid.layers import HybridStates, RopeTables, apply_rope, rope_tables
from rsmem.models.hybrid.qwen35_decode import AttnIn, DeltaDims, QwenChains
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.delta_net import delta_rule, l2_norm
from rsmem.models.ops.norm import rms_norm
from rsmem.models.step.compiled import CompileSetting

__all__ = ["DeltaNet", "GatedAttention", "Qwen35Config", "Qwen35Layer", "Qwen35Model", "Qwen35Weights"]


@dataclass(frozen=True, slots=True)
class Qwen35Config:
    d_model: int
    n_layer: int
    n_vocab: int
    d_ff: int
    n_head: int
    n_head_kv: int
    head_dim: int
    recurrent: tuple[bool, ...]  # per layer: a gated delta net (True) or attention
    d_conv: int = 4
    d_state: int = 128  # dk = dv of the delta net's heads (llama.cpp's ssm.state_size)
    n_k_heads: int = 16  # llama.cpp's ssm.group_count
    n_v_heads: int = 32  # llama.cpp's ssm.time_step_rank
    d_inner: int = 4096  # n_v_heads * dv
    n_rot: int = 64
    rope_base: float = 10_000_000.0
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)
    eps: float = 1e-6
    n_ctx_train: int = 262_144

    def __post_init__(self) -> None:
        ok = (
            len(self.recurrent) == self.n_layer
            and self.n_v_heads % max(1, self.n_k_heads) == 0
            and self.d_inner % max(1, self.n_v_heads) == 0
            and self.d_inner // max(1, self.n_v_heads) == self.d_state
            and 0 < self.n_rot <= self.head_dim
            and self.n_rot % 2 == 0
            and self.n_head % max(1, self.n_head_kv) == 0
            and self.d_conv >= 2
        )
        if not ok:
            raise ValueError(f"inconsistent Qwen3.5 hyperparameters: {self}")

    @property
    def dk(self) -> int:
        return self.d_state

    @property
    def dv(self) -> int:
        return self.d_inner // self.n_v_heads

    @property
    def conv_dim(self) -> int:
        return 2 * self.n_k_heads * self.dk + self.d_inner


@dataclass(slots=True)
class DeltaNet:
    """A gated delta net's weights, ``[out, in]`` as loaded (value heads in llama.cpp's tiled order)."""

    qkv: torch.Tensor  # [conv_dim, d_model]: q (n_k_heads * dk), k, v (d_inner)
    gate: torch.Tensor  # [d_inner, d_model]: z
    beta: torch.Tensor  # [n_v_heads, d_model]
    alpha: torch.Tensor  # [n_v_heads, d_model]
    conv: torch.Tensor  # [conv_dim, d_conv]
    dt_bias: torch.Tensor  # [n_v_heads]
    a: torch.Tensor  # [n_v_heads]: -exp(A_log)
    norm: torch.Tensor  # [dv]
    out: torch.Tensor  # [d_model, d_inner]
    in_t: torch.Tensor | None = None  # held [d_model, conv_dim + d_inner + 2 n_v_heads]: qkv, z, beta, alpha
    out_t: torch.Tensor | None = None  # held [d_inner, d_model]


@dataclass(slots=True)
class GatedAttention:
    """An attention layer's weights (``[out, in]`` as loaded): ``wq`` gives each head's query, then its
    gate."""

    wq: torch.Tensor  # [2 * n_head * head_dim, d_model]
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor  # [d_model, n_head * head_dim]
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    wqkv_t: torch.Tensor | None = None  # held [d_model, 2 n_head hd + 2 n_head_kv hd]
    wo_t: torch.Tensor | None = None


@dataclass(slots=True)
class Qwen35Layer:
    attn_norm: torch.Tensor
    post_norm: torch.Tensor
    ffn_gate: torch.Tensor  # [d_ff, d_model]
    ffn_up: torch.Tensor
    ffn_down: torch.Tensor  # [d_model, d_ff]
    delta: DeltaNet | None = None
    attention: GatedAttention | None = None
    gate_up_t: torch.Tensor | None = None  # held [d_model, 2 d_ff]
    down_t: torch.Tensor | None = None


@dataclass(slots=True)
class Qwen35Weights:
    embedding: torch.Tensor
    layers: list[Qwen35Layer]
    norm_f: torch.Tensor
    lm_head: torch.Tensor


class Qwen35Model(HybridModelBase[QwenChains]):
    """A Qwen3.5 language model for a :class:`~rsmem.memory.hybrid.HybridMemory`."""

    arch = "qwen35"
    kv_cell_ext = True  # M-RoPE: llama.cpp's KV cells keep (x, y, token), written in state bytes
    config: Qwen35Config
    layers: list[Qwen35Layer]

    def __init__(
        self,
        config: Qwen35Config,
        weights: Qwen35Weights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ) -> None:
        """``dtype``: the matrices' and the head's (float32 or bfloat16; the rest is float32); ``compile``:
        see :meth:`set_compile`."""
        kv = config.n_head_kv * config.head_dim
        super().__init__(
            config,
            weights,
            dtype=dtype,
            compile=compile,
            n_embd_r=(config.d_conv - 1) * config.conv_dim,
            n_embd_s=config.n_v_heads * config.dv * config.dk,
            kv_widths=[0 if recurrent else kv for recurrent in config.recurrent],
        )

    def layer_matrices(self, ly: Qwen35Layer) -> list[torch.Tensor]:
        """The layer's ``[out, in]`` matrices to hold: gate and up as one, down, then the operator's two."""
        mats = [torch.cat([ly.ffn_gate, ly.ffn_up]).float(), ly.ffn_down.float()]
        if ly.delta is not None:
            d = ly.delta
            return [*mats, torch.cat([d.qkv, d.gate, d.beta, d.alpha]).float(), d.out.float()]
        assert ly.attention is not None
        att = ly.attention
        return [*mats, torch.cat([att.wq, att.wk, att.wv]).float(), att.wo.float()]

    def set_layer(self, ly: Qwen35Layer, held: list[torch.Tensor]) -> None:
        """Use the held (``[in, out]``) :meth:`layer_matrices`; the loaded matrices become ``[out, in]``
        views of them (no second copy); vectors float32."""
        cfg = self.config
        ly.gate_up_t, ly.down_t = held[0], held[1]
        ly.ffn_gate, ly.ffn_up = held[0].t().split([cfg.d_ff, cfg.d_ff])
        ly.ffn_down = held[1].t()
        ly.attn_norm, ly.post_norm = ly.attn_norm.float(), ly.post_norm.float()
        if ly.delta is not None:
            d = ly.delta
            d.in_t, d.out_t = held[2], held[3]
            nv = cfg.n_v_heads
            d.qkv, d.gate, d.beta, d.alpha = held[2].t().split([cfg.conv_dim, cfg.d_inner, nv, nv])
            d.out = held[3].t()
            vectors = (d.conv, d.dt_bias, d.a, d.norm)
            d.conv, d.dt_bias, d.a, d.norm = (t.float().contiguous() for t in vectors)
        else:
            assert ly.attention is not None
            att = ly.attention
            att.wqkv_t, att.wo_t = held[2], held[3]
            q, kv = 2 * cfg.n_head * cfg.head_dim, cfg.n_head_kv * cfg.head_dim
            att.wq, att.wk, att.wv = held[2].t().split([q, kv, kv])
            att.wo = held[3].t()
            att.q_norm, att.k_norm = att.q_norm.float(), att.k_norm.float()

    # ---------------------------------------------------------- memory layout

    def is_recurrent_layer(self, il: int) -> bool:
        return self.config.recurrent[il]

    def k_shift(self, il: int, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Stored keys moved by ``delta`` positions: NeoX RoPE over the first ``n_rot`` channels (llama.cpp's
        K-shift of an M-RoPE model)."""
        cfg = self.config
        heads = rows.view(-1, cfg.n_head_kv, cfg.head_dim)
        return apply_rope(heads, *rope_tables(delta, cfg.rope_base, cfg.n_rot)).reshape(rows.shape)

    def rope(self, ubatch: UBatch) -> RopeTables:
        """The micro-batch's tables: NeoX RoPE over the first ``n_rot`` channels."""
        return rope_tables(
            torch.tensor(ubatch.pos, dtype=torch.long), self.config.rope_base, self.config.n_rot
        )

    def new_chains(self) -> tuple[QwenChains, QwenChains]:
        cfg = self.config
        dims = DeltaDims(cfg.n_k_heads, cfg.n_v_heads, cfg.dk, cfg.dv, cfg.n_head, cfg.n_head_kv,
                         cfg.head_dim, cfg.eps)  # fmt: skip
        return QwenChains(dims, many=False), QwenChains(dims, many=True)

    # ---------------------------------------------------------------- forward

    def layer_forward(
        self,
        il: int,
        ly: Qwen35Layer,
        x: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        rope: RopeTables | None,
    ) -> torch.Tensor:
        """``x += op(rms_norm(x))`` (delta net or gated attention), then ``x += swiglu(rms_norm(x))``."""
        h = rms_norm(x, ly.attn_norm, self.config.eps)
        if ly.delta is not None:
            x = x + self.delta_net(il, ly.delta, h, states)
        else:
            assert ly.attention is not None and rope is not None
            x = x + self.attention(il, ly.attention, h, ubatch, states, rope)
        assert ly.gate_up_t is not None and ly.down_t is not None
        return self.swiglu(x, ly.post_norm, ly.gate_up_t, ly.down_t)

    def delta_net(self, il: int, d: DeltaNet, h: torch.Tensor, states: HybridStates) -> torch.Tensor:
        """The gated delta net of layer ``il`` on the normed rows ``h`` ``[Bs, L, d_model]``."""
        assert d.in_t is not None and d.out_t is not None
        cfg = self.config
        n_seqs, n_tokens, _ = h.shape
        nk, nv, dk, dv = cfg.n_k_heads, cfg.n_v_heads, cfg.dk, cfg.dv
        r, s = states.read_states(il)
        window = r.view(n_seqs, cfg.conv_dim, cfg.d_conv - 1)
        window = window if window.dtype == torch.float32 else window.float()
        state = s.view(n_seqs, nv, dv, dk)
        state = state if state.dtype == torch.float32 else state.float()
        mixed, z, beta, alpha = self.held.linear(h, d.in_t).split([cfg.conv_dim, cfg.d_inner, nv, nv], dim=-1)
        conv = F.silu(causal_conv1d_(mixed, window, d.conv, None))
        q, k, v = conv.split([nk * dk, nk * dk, cfg.d_inner], dim=-1)
        q = l2_norm(q.reshape(n_seqs, n_tokens, nk, dk), cfg.eps) * (1.0 / math.sqrt(dk))
        k = l2_norm(k.reshape(n_seqs, n_tokens, nk, dk), cfg.eps)
        if nv != nk:  # tiled: value head h reads key head h % nk
            q, k = q.repeat(1, 1, nv // nk, 1), k.repeat(1, 1, nv // nk, 1)
        g = F.softplus(alpha + d.dt_bias) * d.a
        o = delta_rule(q, k, v.reshape(n_seqs, n_tokens, nv, dv), g, torch.sigmoid(beta), state)
        o = rms_norm(o, d.norm, cfg.eps) * F.silu(z.reshape(n_seqs, n_tokens, nv, dv))
        states.write_states(il, window, state)
        return self.held.linear(o.reshape(n_seqs, n_tokens, cfg.d_inner), d.out_t)

    def attention(
        self,
        il: int,
        att: GatedAttention,
        h: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        rope: RopeTables,
    ) -> torch.Tensor:
        """The gated attention of layer ``il`` on the normed rows ``h`` ``[Bs, L, d_model]``."""
        assert att.wqkv_t is not None and att.wo_t is not None
        cfg = self.config
        n_seqs, n_tokens, _ = h.shape
        hd, nh, nkv = cfg.head_dim, cfg.n_head, cfg.n_head_kv
        flat = h.reshape(n_seqs * n_tokens, -1)
        qg, k, v = self.held.linear(flat, att.wqkv_t).split([2 * nh * hd, nkv * hd, nkv * hd], dim=-1)
        q, gate = qg.reshape(-1, nh, 2 * hd).split([hd, hd], dim=-1)
        q = apply_rope(rms_norm(q, att.q_norm, cfg.eps), *rope)
        k = apply_rope(rms_norm(k.reshape(-1, nkv, hd), att.k_norm, cfg.eps), *rope)
        out = states.attention(il, q, k, v.reshape(-1, nkv, hd), 1.0 / math.sqrt(hd), ubatch)
        out = out * torch.sigmoid(gate.reshape(-1, nh * hd))
        return self.held.linear(out, att.wo_t).view(n_seqs, n_tokens, -1)

    # ----------------------------------------------------------------- decode

    def state_views(self, r: torch.Tensor, s: torch.Tensor, n_seqs: int) -> tuple[torch.Tensor, ...]:
        """The conv window ``[Bs, conv_dim, d_conv - 1]`` and the heads' states ``[Bs, H, dv, dk]``."""
        cfg = self.config
        return r.view(n_seqs, cfg.conv_dim, cfg.d_conv - 1), s.view(n_seqs, cfg.n_v_heads, cfg.dv, cfg.dk)

    def chain_steps(
        self, mat: Operand, many: bool, fills: StateFills, rope: RopeTables | None
    ) -> list[tuple[Any, ...] | AttnIn]:
        """The layers as :mod:`rsmem.models.hybrid.qwen35_decode` takes them: a delta net layer's tensors
        (its window and state from ``fills``, updated in place) or an :class:`AttnIn`."""
        assert rope is not None
        cos, sin = rope
        layers: list[tuple[Any, ...] | AttnIn] = []
        for il, ly in enumerate(self.layers):
            assert ly.gate_up_t is not None and ly.down_t is not None
            ffn = (ly.post_norm, mat(ly.gate_up_t), mat(ly.down_t))
            if ly.delta is None:
                att = ly.attention
                assert att is not None and att.wqkv_t is not None and att.wo_t is not None
                attn_in = (ly.attn_norm, mat(att.wqkv_t), att.q_norm, att.k_norm, cos, sin)
                layers.append(AttnIn(il, attn_in, (mat(att.wo_t), *ffn)))
                continue
            d = ly.delta
            assert d.in_t is not None and d.out_t is not None
            layers.append((ly.attn_norm, mat(d.in_t), d.conv, d.dt_bias, d.a, d.norm, mat(d.out_t), *ffn,
                           *fills[il]))  # fmt: skip
        return layers

    def run_chains(
        self,
        chains: QwenChains,
        x: torch.Tensor,
        steps: list[Any],
        tail: str,
        tail_tensors: tuple[Any, ...],
        attend: Attend,
    ) -> torch.Tensor:
        """Every attention layer's scale is ``1 / sqrt(head_dim)``: the chains' ``attend`` takes none."""
        scale = 1.0 / math.sqrt(self.config.head_dim)
        return chains.run(x, steps, tail, tail_tensors, lambda il, q, k, v: attend(il, q, k, v, scale))
