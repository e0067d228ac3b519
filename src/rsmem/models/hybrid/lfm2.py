"""LFM2 (Liquid AI) on rsmem's hybrid memory, computed as llama.cpp's ``lfm2`` graph.

Per layer: ``x += op(rms_norm(x))``, then ``x += swiglu(rms_norm(x))``. The operator is either a short
convolution (``in_proj`` gives ``b, c, x``; ``y = c * conv(b * x)``; the state is only the conv window of
``b * x``, ``[n_embd, L_cache - 1]``, llama.cpp's ``r`` row; ``s`` is empty) or grouped-query attention with
RMS-normed q and k per head and NeoX RoPE over the whole head, its keys and values in the KV cache. After
the last layer: RMS norm (``token_embd_norm`` in the GGUF) and the LM head.

Matrices are held as :mod:`rsmem.models.hybrid.layers` says (oneDNN twins; gate and up one product). A
decode step (one token of each sequence) runs through ``torch.compile`` when the model compiles
(:mod:`rsmem.models.step.compiled`'s policy and checked fallback): one compiled chain of blocks
(:mod:`rsmem.models.step.hybrid_fused`) per stretch between attention layers
(:mod:`rsmem.models.hybrid.chains`), one sequence's streaming ``[out, in]`` rows, several sequences' with
the few-row kernel's operands (:func:`~rsmem.models.hybrid.layers.many_operand`) and a dynamic batch;
prefill is eager.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rsmem.batch.batch import UBatch
from rsmem.models.hybrid import native as hybrid_native
from rsmem.models.hybrid.base import HybridModelBase, Operand, StateFills, attention_step, native_attention
from rsmem.models.hybrid.chains import AttentionStep, Chains, Step
from rsmem.models.hybrid.layers import Attention, HybridStates, RopeTables, rope_neox
from rsmem.models.hybrid.native import NativeBlock
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.norm import rms_norm
from rsmem.models.step.compiled import CompileSetting
from rsmem.models.step.hybrid_fused import (
    Block,
    lfm2_attn_out_many,
    lfm2_attn_out_one,
    lfm2_conv_many_,
    lfm2_conv_one_,
)

__all__ = ["Attention", "HybridStates", "Lfm2Config", "Lfm2Layer", "Lfm2Model", "Lfm2Weights", "rope_neox"]


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
    """One layer's weights: ``[out, in]`` as loaded; after the model holds them, the matrices are the
    ``[in, out]`` tensors of :class:`~rsmem.models.hybrid.layers.HeldMatrices` (``gate_up`` the gate and up
    rows as one, ``ffn_gate`` / ``ffn_up`` views of it)."""

    attn_norm: torch.Tensor
    ffn_norm: torch.Tensor
    ffn_gate: torch.Tensor  # [d_ff, d_model]
    ffn_up: torch.Tensor
    ffn_down: torch.Tensor  # [d_model, d_ff]
    attention: Attention | None = None
    conv: torch.Tensor | None = None  # [d_model, l_cache]
    conv_in: torch.Tensor | None = None  # [3 * d_model, d_model]: b, c, x
    conv_out: torch.Tensor | None = None  # [d_model, d_model]
    gate_up: torch.Tensor | None = None  # held: [d_model, 2 * d_ff]


@dataclass(slots=True)
class Lfm2Weights:
    embedding: torch.Tensor
    layers: list[Lfm2Layer]
    norm_f: torch.Tensor
    lm_head: torch.Tensor


class Lfm2Model(HybridModelBase[Chains]):
    """An LFM2 language model for a :class:`~rsmem.memory.hybrid.HybridMemory`."""

    arch = "lfm2"
    config: Lfm2Config
    layers: list[Lfm2Layer]

    def __init__(
        self,
        config: Lfm2Config,
        weights: Lfm2Weights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ) -> None:
        """``dtype``: the matrices' and the head's (float32 or bfloat16; the rest is float32);
        ``compile``: see :meth:`set_compile`."""
        super().__init__(
            config,
            weights,
            dtype=dtype,
            compile=compile,
            n_embd_r=(config.l_cache - 1) * config.d_model,
            n_embd_s=0,  # the conv window is all of a layer's state
            kv_widths=[n * config.head_dim for n in config.n_head_kv],
        )

    def layer_matrices(self, ly: Lfm2Layer) -> list[torch.Tensor]:
        """The layer's ``[out, in]`` matrices to hold: gate and up as one, down, then the operator's."""
        gate_up, down = torch.cat([ly.ffn_gate, ly.ffn_up]).float(), ly.ffn_down.float()
        if ly.attention is not None:
            return [gate_up, down, *ly.attention.matrices()]
        assert ly.conv_in is not None and ly.conv_out is not None
        return [gate_up, down, ly.conv_in.float(), ly.conv_out.float()]

    def set_layer(self, ly: Lfm2Layer, held: list[torch.Tensor]) -> None:
        """Use the held (``[in, out]``) :meth:`layer_matrices`; vectors float32."""
        d_ff = ly.ffn_gate.shape[0]
        ly.gate_up, ly.ffn_down = held[0], held[1]
        ly.ffn_gate, ly.ffn_up = ly.gate_up[:, :d_ff], ly.gate_up[:, d_ff:]
        ly.attn_norm, ly.ffn_norm = ly.attn_norm.float(), ly.ffn_norm.float()
        if ly.attention is not None:
            ly.attention.set_held(self.held, held[2], held[3])
        else:
            assert ly.conv is not None
            ly.conv = ly.conv.float().contiguous()
            ly.conv_in, ly.conv_out = held[2], held[3]

    def is_recurrent_layer(self, il: int) -> bool:
        return self.config.n_head_kv[il] == 0

    def new_chains(self) -> tuple[Chains, Chains]:
        """The chains of one sequence and of one token of each of several (and the blocks they run)."""
        eps = self.config.eps
        self._conv = Block(lfm2_conv_one_, 8, (eps,), mutated=(7,))  # its window is written
        self._attn_out = Block(lfm2_attn_out_one, 5, (eps,))  # o, wo, ffn_norm, gate_up, down
        self._conv_many = Block(lfm2_conv_many_, 8, (eps,), mutated=(7,))
        self._attn_out_many = Block(lfm2_attn_out_many, 5, (eps,), batch=(0,))  # o: one row a sequence
        return Chains(), Chains(many=True)

    def layer_forward(
        self,
        il: int,
        ly: Lfm2Layer,
        x: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        rope: RopeTables | None,
    ) -> torch.Tensor:
        """``x += op(rms_norm(x))``, then ``x += swiglu(rms_norm(x))``."""
        h = rms_norm(x, ly.attn_norm, self.config.eps)
        if ly.attention is not None:
            x = x + ly.attention.forward(il, h, ubatch, states, self.config.eps, rope)
        else:
            x = x + self.short_conv(il, ly, h, states)
        assert ly.gate_up is not None
        return self.swiglu(x, ly.ffn_norm, ly.gate_up, ly.ffn_down)

    def short_conv(self, il: int, ly: Lfm2Layer, h: torch.Tensor, states: HybridStates) -> torch.Tensor:
        """The short convolution of layer ``il`` on the normed rows ``h`` ``[Bs, L, d_model]``."""
        assert ly.conv is not None and ly.conv_in is not None and ly.conv_out is not None
        r, s = states.read_states(il)
        window = r.view(h.shape[0], self.config.d_model, self.config.l_cache - 1)
        work = window if window.dtype == torch.float32 else window.float()
        b, c, xx = self.held.linear(h, ly.conv_in).chunk(3, dim=-1)
        y = c * causal_conv1d_(b * xx, work, ly.conv, None)
        states.write_states(il, work, s)
        return self.held.linear(y, ly.conv_out)

    def state_views(self, r: torch.Tensor, s: torch.Tensor, n_seqs: int) -> tuple[torch.Tensor, ...]:
        """The conv window ``[Bs, d_model, L_cache - 1]`` (``s`` is empty)."""
        return (r.view(n_seqs, self.config.d_model, self.config.l_cache - 1),)

    def native_blocks(self, mat: Operand) -> list[NativeBlock]:
        """Each layer's operator (short convolution or attention), then its SwiGLU."""
        blocks = []
        for il, ly in enumerate(self.layers):
            if ly.attention is not None:
                blocks.append(native_attention(il, ly.attn_norm, ly.attention, mat))
            else:
                assert ly.conv_in is not None and ly.conv_out is not None
                tensors = (ly.attn_norm, mat(ly.conv_in), ly.conv, mat(ly.conv_out), None)
                blocks.append(NativeBlock(hybrid_native.CONV, il, tensors))
            assert ly.gate_up is not None
            ffn = (ly.ffn_norm, mat(ly.gate_up), mat(ly.ffn_down))
            blocks.append(NativeBlock(hybrid_native.SWIGLU, il, ffn))
        return blocks

    def chain_steps(
        self, mat: Operand, many: bool, fills: StateFills, rope: RopeTables | None
    ) -> list[Step | AttentionStep]:
        """A short convolution layer is one block (its window from ``fills``, updated in place); an attention
        layer's SwiGLU follows its output product."""
        eps = self.config.eps
        conv_block, out_block = (
            (self._conv_many, self._attn_out_many) if many else (self._conv, self._attn_out)
        )
        steps: list[Step | AttentionStep] = []
        for il, ly in enumerate(self.layers):
            assert ly.gate_up is not None
            ffn = (ly.ffn_norm, mat(ly.gate_up), mat(ly.ffn_down))
            if ly.attention is not None:
                steps.append(attention_step(il, ly.attn_norm, ly.attention, mat, rope, eps, out_block, ffn))
                continue
            assert ly.conv is not None and ly.conv_in is not None and ly.conv_out is not None
            conv = (ly.attn_norm, mat(ly.conv_in), ly.conv, mat(ly.conv_out))
            steps.append(Step(conv_block, (*conv, *ffn, *fills[il])))
        return steps
