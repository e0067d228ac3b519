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

from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.hybrid import native as hybrid_native
from rsmem.models.hybrid.chains import AttentionStep, Chains, Step
from rsmem.models.hybrid.layers import (
    Attention,
    HeldMatrices,
    HybridStates,
    RopeTables,
    hold_model,
    many_head,
    many_operand,
    one_operand,
    rope_neox,
    warm_up_decode,
)
from rsmem.models.hybrid.native import NativeBlock
from rsmem.models.ops.common import output_rows
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.norm import rms_norm
from rsmem.models.protocol import StateAccess
from rsmem.models.step.compiled import CompileSetting, resolve_compile
from rsmem.models.step.hybrid_fused import (
    Block,
    lfm2_attn_out_many,
    lfm2_attn_out_one,
    lfm2_conv_many_,
    lfm2_conv_one_,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

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


class Lfm2Model:
    """An LFM2 language model for a :class:`~rsmem.memory.hybrid.HybridMemory`."""

    arch = "lfm2"

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
        self.config = config
        self.n_vocab = config.n_vocab
        self.n_layer = config.n_layer
        self.n_embd_r = (config.l_cache - 1) * config.d_model
        self.n_embd_s = 0
        self.tokenizer: Tokenizer | None = None
        f32 = torch.float32
        self.held = HeldMatrices(dtype)
        self.embedding = weights.embedding.to(f32).contiguous()
        self.norm_f = weights.norm_f.to(f32)
        head = None if weights.lm_head is weights.embedding else weights.lm_head  # None: tied
        self.layers = weights.layers
        per_layer = [self._layer_matrices(ly) for ly in self.layers]
        self.embedding, self.lm_head, held = hold_model(self.held, self.embedding, head, per_layer)
        matrices = [self.lm_head, *(m for mats in held for m in mats)]  # [in, out], the head first
        for ly, mats in zip(self.layers, held, strict=True):
            self._set_layer(ly, mats)
        self.kv_layers: Mapping[int, tuple[int, int]] = {
            il: (n * config.head_dim, n * config.head_dim) for il, n in enumerate(config.n_head_kv) if n
        }
        self._n_matrix_weights = sum(m.numel() for m in matrices)
        # the one-sequence compiled blocks stream [out, in] rows: float32 matrices held as views of them
        self._rows_contiguous = all(m.t().is_contiguous() for m in matrices)
        self.compile_decode = False
        self._native: hybrid_native.HybridNativeStep | None = None
        self.set_compile(compile)

    @staticmethod
    def _layer_matrices(ly: Lfm2Layer) -> list[torch.Tensor]:
        """The layer's ``[out, in]`` matrices to hold: gate and up as one, down, then the operator's."""
        gate_up, down = torch.cat([ly.ffn_gate, ly.ffn_up]).float(), ly.ffn_down.float()
        if ly.attention is not None:
            return [gate_up, down, *ly.attention.matrices()]
        assert ly.conv_in is not None and ly.conv_out is not None
        return [gate_up, down, ly.conv_in.float(), ly.conv_out.float()]

    def _set_layer(self, ly: Lfm2Layer, held: list[torch.Tensor]) -> None:
        """Use the held (``[in, out]``) :meth:`_layer_matrices`; vectors float32."""
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

    def k_shift(self, il: int, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        attention = self.layers[il].attention
        return rows if attention is None else attention.k_shift(rows, delta)

    def set_compile(self, setting: CompileSetting) -> bool:
        """Whether one-sequence decode steps run compiled (:mod:`rsmem.models.step.compiled`: ``"auto"``,
        True/False, ``"1"``/``"0"``; None reads ``RSMEM_COMPILE``); only with float32 ``[out, in]`` rows.
        Returns the decision."""
        decided = resolve_compile(setting, self._n_matrix_weights, self.embedding.device)
        self.compile_decode = decided and self._rows_contiguous
        if self.compile_decode and not hasattr(self, "_chains"):
            eps = self.config.eps
            self._conv = Block(lfm2_conv_one_, 8, (eps,), mutated=(7,))  # its window is written
            self._attn_out = Block(lfm2_attn_out_one, 5, (eps,))  # o, wo, ffn_norm, gate_up, down
            self._conv_many = Block(lfm2_conv_many_, 8, (eps,), mutated=(7,))
            self._attn_out_many = Block(lfm2_attn_out_many, 5, (eps,), batch=(0,))  # o: one row a sequence
            self._chains = Chains()  # one sequence
            self._chains_many = Chains(many=True)  # one token of each of several
        return self.compile_decode

    def warm_up(self) -> float:
        """Compile the decode steps (one sequence, several) now; the seconds it took (0: not compiling)."""
        return warm_up_decode(self) if self.compile_decode else 0.0

    def rope(self, ubatch: UBatch) -> RopeTables | None:
        """The micro-batch's RoPE tables (every attention layer has the same)."""
        first = next((ly.attention for ly in self.layers if ly.attention is not None), None)
        return None if first is None else first.rope_for(ubatch)

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; ``states`` must be a hybrid memory's context."""
        hybrid = cast(HybridStates, states)  # RecurrentModel's signature; attention needs HybridStates
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        n_seqs, n_tokens = tokens.shape
        if self.compile_decode and n_tokens == 1:
            logits = self._decode(tokens[:, 0], ubatch, hybrid)
            if logits is not None:
                return logits
        rope = self.rope(ubatch)
        linear = self.held.linear
        x = self.embedding[tokens]  # [Bs, L, d_model]
        for il, ly in enumerate(self.layers):
            h = rms_norm(x, ly.attn_norm, cfg.eps)
            if ly.attention is not None:
                x = x + ly.attention.forward(il, h, ubatch, hybrid, cfg.eps, rope)
            else:
                x = x + self.short_conv(il, ly, h, hybrid, n_seqs)
            assert ly.gate_up is not None
            g, u = linear(rms_norm(x, ly.ffn_norm, cfg.eps), ly.gate_up).chunk(2, dim=-1)
            x = x + linear(F.silu(g) * u, ly.ffn_down)
        x = output_rows(x, ubatch.output_rows())
        return linear(rms_norm(x, self.norm_f, cfg.eps), self.lm_head)

    def short_conv(
        self, il: int, ly: Lfm2Layer, h: torch.Tensor, states: HybridStates, n_seqs: int
    ) -> torch.Tensor:
        assert ly.conv is not None and ly.conv_in is not None and ly.conv_out is not None
        r, s = states.read_states(il)
        window = r.view(n_seqs, self.config.d_model, self.config.l_cache - 1)
        work = window if window.dtype == torch.float32 else window.float()
        b, c, xx = self.held.linear(h, ly.conv_in).chunk(3, dim=-1)
        y = c * causal_conv1d_(b * xx, work, ly.conv, None)
        states.write_states(il, work, s)
        return self.held.linear(y, ly.conv_out)

    def _decode(self, tokens: torch.Tensor, ubatch: UBatch, states: HybridStates) -> torch.Tensor | None:
        """One token of each sequence (``tokens`` ``[Bs]``): the C++ step (:mod:`rsmem.models.hybrid.native`)
        where it runs, else compiled chains between the attention layers (:meth:`_chains_logits`); None
        (nothing read) when the state rows are not float32."""
        cfg = self.config
        rows = {il: states.read_states(il) for il in range(self.n_layer) if self.is_recurrent_layer(il)}
        if any(r.dtype != torch.float32 for r, _ in rows.values()):
            return None  # decoded eagerly: reading the rows again is harmless
        n_seqs = tokens.shape[0]
        windows = {il: r.view(n_seqs, cfg.d_model, cfg.l_cache - 1) for il, (r, _) in rows.items()}
        x = self.embedding[tokens]  # [Bs, d_model]
        rope = self.rope(ubatch)
        twin = partial(self._chains_logits, x, ubatch, states, windows, rope)
        fills = {il: (w,) for il, w in windows.items()}
        logits = hybrid_native.decode(self._native_step(), x, ubatch, states, fills, rope, twin)
        for il, window in windows.items():
            states.write_states(il, window, rows[il][1])
        return logits

    def _native_step(self) -> hybrid_native.HybridNativeStep:
        """The C++ step over this model's blocks, built at its first use."""
        if self._native is None:
            mat = partial(one_operand, self.held)
            blocks = []
            for il, ly in enumerate(self.layers):
                att = ly.attention
                tensors: tuple[Any, ...]
                if att is not None:
                    assert att.wqkv_t is not None and att.wo_t is not None
                    qk_norms = (att.q_norm, att.k_norm)
                    tensors = (ly.attn_norm, mat(att.wqkv_t), *qk_norms, mat(att.wo_t), None, None)
                    heads = (att.n_head, att.n_head_kv)
                    blocks.append(NativeBlock(hybrid_native.ATTENTION, il, tensors, heads, att.scale))
                else:
                    assert ly.conv_in is not None and ly.conv_out is not None
                    tensors = (ly.attn_norm, mat(ly.conv_in), ly.conv, mat(ly.conv_out), None)
                    blocks.append(NativeBlock(hybrid_native.CONV, il, tensors))
                assert ly.gate_up is not None
                ffn = (ly.ffn_norm, mat(ly.gate_up), mat(ly.ffn_down))
                blocks.append(NativeBlock(hybrid_native.SWIGLU, il, ffn))
            head = one_operand(self.held, self.lm_head)
            self._native = hybrid_native.HybridNativeStep(blocks, self.norm_f, head, 1, self.config.eps)
        return self._native

    def _chains_logits(
        self,
        x: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        windows: Mapping[int, torch.Tensor],
        rope: RopeTables | None,
    ) -> torch.Tensor:
        """The decode step as compiled chains between the attention layers (:mod:`rsmem.models.hybrid.chains`:
        one sequence's blocks stream ``[out, in]`` rows, several sequences' the few-row kernel's operands);
        ``windows`` are updated in place."""
        cfg = self.config
        many = x.shape[0] > 1
        mat = partial(many_operand if many else one_operand, self.held)
        conv_block, out_block = (
            (self._conv_many, self._attn_out_many) if many else (self._conv, self._attn_out)
        )
        cos, sin = rope if rope is not None else (None, None)
        steps: list[Step | AttentionStep] = []
        for il, ly in enumerate(self.layers):
            att = ly.attention
            assert ly.gate_up is not None
            ffn = (ly.ffn_norm, mat(ly.gate_up), mat(ly.ffn_down))
            if att is not None:
                assert att.wqkv_t is not None and att.wo_t is not None
                attn_in = (ly.attn_norm, mat(att.wqkv_t), att.q_norm, att.k_norm, cos, sin)
                consts = (att.n_head, att.n_head_kv, cfg.eps)
                steps.append(AttentionStep(il, attn_in, consts, att.scale, out_block, (mat(att.wo_t), *ffn)))
                continue
            assert ly.conv is not None and ly.conv_in is not None and ly.conv_out is not None
            conv = (ly.attn_norm, mat(ly.conv_in), ly.conv, mat(ly.conv_out))
            steps.append(Step(conv_block, (*conv, *ffn, windows[il])))

        def attend(il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            return states.attention(il, q, k, v, scale, ubatch)

        if many:
            h = self._chains_many.run(x, steps, "norm", (self.norm_f,), cfg.eps, attend)
            return many_head(self.held, output_rows(h, ubatch.output_rows()), self.lm_head)
        head = one_operand(self.held, self.lm_head)
        logits = self._chains.run(x, steps, "head", (self.norm_f, head), cfg.eps, attend)
        return logits[: len(ubatch.output_rows())]
