"""Nemotron-H (dense) on rsmem's hybrid memory, computed as llama.cpp's ``nemotron_h`` graph.

Every layer is ``x += block(rms_norm(x))`` with one of three blocks: a Mamba-2 mixer (its conv window and
SSM state in the recurrent memory, llama.cpp's Mamba-2 rows), grouped-query attention without RoPE (keys
and values in the KV cache; the GGUF's q/k rows carry LLaMA's permutation, which leaves attention
unchanged), or a squared-ReLU MLP (no memory at all). Then RMS norm and the LM head. Mamba-2's kernels
from :mod:`rsmem.models.ops`.

Matrices are held as :mod:`rsmem.models.hybrid.layers` says (oneDNN twins). When the model compiles, a
decode step (one token of each sequence) is one compiled chain per stretch between attention layers
(:mod:`rsmem.models.hybrid.chains`; Mamba-2's blocks from :mod:`rsmem.models.step.fused`, the others from
:mod:`rsmem.models.step.hybrid_fused`): one sequence's streaming ``[out, in]`` rows, several sequences'
with the few-row kernel's operands (:func:`~rsmem.models.hybrid.layers.many_operand`) and a dynamic batch.
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
    hold_model,
    many_head,
    many_operand,
    one_operand,
    warm_up_decode,
)
from rsmem.models.hybrid.native import NativeBlock
from rsmem.models.ops.common import output_rows
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.norm import gated_group_rms_norm, rms_norm
from rsmem.models.ops.ssd import ssd_chunked_
from rsmem.models.protocol import StateAccess
from rsmem.models.step.compiled import CompileSetting, resolve_compile
from rsmem.models.step.fused import mamba2_layer_many_, mamba2_layer_one_
from rsmem.models.step.hybrid_fused import (
    Block,
    attn_out_many,
    attn_out_one,
    relu2_mlp_many,
    relu2_mlp_one,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer

MAMBA, ATTENTION, MLP = "M", "*", "-"  # the layer pattern letters of Nemotron-H's configs


@dataclass(frozen=True, slots=True)
class NemotronHConfig:
    d_model: int
    n_vocab: int
    kinds: str  # one letter per layer: M (Mamba-2), * (attention), - (MLP)
    d_inner: int
    d_state: int
    d_conv: int
    n_ssm_head: int
    n_group: int
    n_head: int
    n_head_kv: tuple[int, ...]  # per layer (0 except attention layers)
    head_dim: int
    d_ff: tuple[int, ...]  # per layer (0 except MLP layers)
    eps: float = 1e-5
    chunk_size: int = 64  # SSD chunk length for prefill

    def __post_init__(self) -> None:
        n = len(self.kinds)
        ok = len(self.n_head_kv) == len(self.d_ff) == n and set(self.kinds) <= {MAMBA, ATTENTION, MLP}
        if not ok or self.d_inner % self.n_ssm_head or self.n_ssm_head % self.n_group:
            raise ValueError(f"inconsistent Nemotron-H hyperparameters: {self}")

    @property
    def n_layer(self) -> int:
        return len(self.kinds)

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.n_group * self.d_state

    @property
    def ssm_head_dim(self) -> int:
        return self.d_inner // self.n_ssm_head


@dataclass(slots=True)
class Mamba2Mixer:
    in_proj: torch.Tensor  # [d_inner + conv_dim + n_head, d_model]: z, xBC, dt
    conv_weight: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: torch.Tensor | None
    dt_bias: torch.Tensor  # [n_head]
    A: torch.Tensor  # [n_head], -exp(A_log)
    D: torch.Tensor
    ssm_norm: torch.Tensor  # [d_inner]
    out_proj: torch.Tensor  # [d_model, d_inner]


@dataclass(slots=True)
class NemotronHLayer:
    norm: torch.Tensor
    mixer: Mamba2Mixer | None = None
    attention: Attention | None = None
    ffn_up: torch.Tensor | None = None  # [d_ff, d_model]
    ffn_down: torch.Tensor | None = None  # [d_model, d_ff]


@dataclass(slots=True)
class NemotronHWeights:
    embedding: torch.Tensor
    layers: list[NemotronHLayer]
    norm_f: torch.Tensor
    lm_head: torch.Tensor


class NemotronHModel:
    """A Nemotron-H language model for a :class:`~rsmem.memory.hybrid.HybridMemory`. After construction
    the layers' matrices are the ``[in, out]`` tensors of
    :class:`~rsmem.models.hybrid.layers.HeldMatrices`."""

    arch = "nemotron_h"

    def __init__(
        self,
        config: NemotronHConfig,
        weights: NemotronHWeights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ) -> None:
        """``dtype``: the matrices' and the head's (float32 or bfloat16; the rest is float32);
        ``compile``: see :meth:`set_compile`."""
        cfg = config
        self.config = cfg
        self.n_vocab = cfg.n_vocab
        self.n_layer = cfg.n_layer
        self.n_embd_r = (cfg.d_conv - 1) * cfg.conv_dim
        self.n_embd_s = cfg.d_state * cfg.d_inner
        self.tokenizer: Tokenizer | None = None
        self.held = HeldMatrices(dtype)
        self.embedding = weights.embedding.float().contiguous()
        self.norm_f = weights.norm_f.float()
        head = None if weights.lm_head is weights.embedding else weights.lm_head  # None: tied
        self.layers = weights.layers
        per_layer = [self._layer_matrices(ly) for ly in self.layers]
        self.embedding, self.lm_head, held = hold_model(self.held, self.embedding, head, per_layer)
        matrices = [self.lm_head, *(m for mats in held for m in mats)]  # [in, out], the head first
        for ly, mats in zip(self.layers, held, strict=True):
            self._set_layer(ly, mats)
        self.kv_layers: Mapping[int, tuple[int, int]] = {
            il: (n * cfg.head_dim, n * cfg.head_dim)
            for il, n in enumerate(cfg.n_head_kv)
            if cfg.kinds[il] == ATTENTION
        }
        self._n_matrix_weights = sum(m.numel() for m in matrices)
        # the one-sequence compiled blocks stream [out, in] rows: float32 matrices held as views of them
        self._rows_contiguous = all(m.t().is_contiguous() for m in matrices)
        self.compile_decode = False
        self._native: hybrid_native.HybridNativeStep | None = None
        self.set_compile(compile)

    @staticmethod
    def _layer_matrices(ly: NemotronHLayer) -> list[torch.Tensor]:
        """The layer's ``[out, in]`` matrices to hold."""
        if ly.mixer is not None:
            return [ly.mixer.in_proj.float(), ly.mixer.out_proj.float()]
        if ly.attention is not None:
            return ly.attention.matrices()
        assert ly.ffn_up is not None and ly.ffn_down is not None
        return [ly.ffn_up.float(), ly.ffn_down.float()]

    def _set_layer(self, ly: NemotronHLayer, held: list[torch.Tensor]) -> None:
        """Use the held (``[in, out]``) :meth:`_layer_matrices`; vectors float32."""
        ly.norm = ly.norm.float()
        if ly.mixer is not None:
            ly.mixer.in_proj, ly.mixer.out_proj = held
            ly.mixer.conv_weight = ly.mixer.conv_weight.float().contiguous()
        elif ly.attention is not None:
            ly.attention.set_held(self.held, *held)
        else:
            ly.ffn_up, ly.ffn_down = held

    def is_recurrent_layer(self, il: int) -> bool:
        return self.config.kinds[il] == MAMBA

    def k_shift(self, il: int, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return rows  # no RoPE: keys do not depend on positions

    def set_compile(self, setting: CompileSetting) -> bool:
        """Whether decode steps run compiled (:mod:`rsmem.models.step.compiled`: ``"auto"``, True/False,
        ``"1"``/``"0"``; None reads ``RSMEM_COMPILE``); only with float32 ``[out, in]`` rows. Returns the
        decision."""
        decided = resolve_compile(setting, self._n_matrix_weights, self.embedding.device)
        self.compile_decode = decided and self._rows_contiguous
        if self.compile_decode and not hasattr(self, "_chains"):
            cfg = self.config
            self._mamba = Block(mamba2_layer_one_, 11, (cfg.n_group, cfg.eps), mutated=(9, 10))  # window, h
            self._mlp = Block(relu2_mlp_one, 3, (cfg.eps,))
            self._attn_out = Block(attn_out_one, 2)  # o, wo
            self._chains = Chains()  # one sequence
            self._mamba_many = Block(mamba2_layer_many_, 11, (cfg.n_group, cfg.eps), mutated=(9, 10))
            self._mlp_many = Block(relu2_mlp_many, 3, (cfg.eps,))
            self._attn_out_many = Block(attn_out_many, 2, batch=(0,))  # o: one row a sequence
            self._chains_many = Chains(many=True)  # one token of each of several sequences
        return self.compile_decode

    def warm_up(self) -> float:
        """Compile the decode steps (one sequence, several) now; the seconds it took (0: not compiling)."""
        return warm_up_decode(self) if self.compile_decode else 0.0

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; ``states`` must be a hybrid memory's context."""
        hybrid = cast(HybridStates, states)  # RecurrentModel's signature; attention needs HybridStates
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        if self.compile_decode and tokens.shape[1] == 1:
            logits = self._decode(tokens[:, 0], ubatch, hybrid)
            if logits is not None:
                return logits
        linear = self.held.linear
        x = self.embedding[tokens]
        for il, ly in enumerate(self.layers):
            h = rms_norm(x, ly.norm, cfg.eps)
            if ly.mixer is not None:
                x = x + self.mamba2(il, ly.mixer, h, hybrid)
            elif ly.attention is not None:
                x = x + ly.attention.forward(il, h, ubatch, hybrid, cfg.eps)
            else:
                assert ly.ffn_up is not None and ly.ffn_down is not None
                x = x + linear(torch.relu(linear(h, ly.ffn_up)).square(), ly.ffn_down)
        x = output_rows(x, ubatch.output_rows())
        return linear(rms_norm(x, self.norm_f, cfg.eps), self.lm_head)

    def mamba2(self, il: int, mx: Mamba2Mixer, u: torch.Tensor, states: HybridStates) -> torch.Tensor:
        """Mamba-2's SSD block over ``u`` ``[Bs, L, d_model]`` from the layer's states, which it updates."""
        cfg = self.config
        n_seqs, n_tokens, _ = u.shape
        r, s = states.read_states(il)
        window = r.view(n_seqs, cfg.conv_dim, cfg.d_conv - 1).float()
        h = s.view(n_seqs, cfg.n_ssm_head, cfg.ssm_head_dim, cfg.d_state).float()
        zxbcdt = self.held.linear(u, mx.in_proj)
        z, xbc, dt = zxbcdt.split([cfg.d_inner, cfg.conv_dim, cfg.n_ssm_head], dim=-1)
        xbc = F.silu(causal_conv1d_(xbc, window, mx.conv_weight, mx.conv_bias))
        gn = cfg.n_group * cfg.d_state
        x, B, C = xbc.split([cfg.d_inner, gn, gn], dim=-1)
        y = ssd_chunked_(
            x.reshape(n_seqs, n_tokens, cfg.n_ssm_head, cfg.ssm_head_dim),
            F.softplus(dt + mx.dt_bias),
            mx.A,
            B.reshape(n_seqs, n_tokens, cfg.n_group, cfg.d_state),
            C.reshape(n_seqs, n_tokens, cfg.n_group, cfg.d_state),
            mx.D,
            h,
            chunk_size=cfg.chunk_size,
        )
        states.write_states(il, window, h)
        y = gated_group_rms_norm(
            y.reshape(n_seqs, n_tokens, cfg.d_inner), z, mx.ssm_norm, cfg.n_group, cfg.eps
        )
        return self.held.linear(y, mx.out_proj)

    def _decode(self, tokens: torch.Tensor, ubatch: UBatch, states: HybridStates) -> torch.Tensor | None:
        """One token of each sequence (``tokens`` ``[Bs]``): the C++ step (:mod:`rsmem.models.hybrid.native`)
        where it runs, else compiled chains between the attention layers (:meth:`_chains_logits`); None
        (nothing read) when the state rows are not float32."""
        cfg = self.config
        rows = {il: states.read_states(il) for il in range(self.n_layer) if self.is_recurrent_layer(il)}
        if any(r.dtype != torch.float32 or s.dtype != torch.float32 for r, s in rows.values()):
            return None  # decoded eagerly: reading the rows again is harmless
        n_seqs = tokens.shape[0]
        views = {
            il: (
                r.view(n_seqs, cfg.conv_dim, cfg.d_conv - 1),
                s.view(n_seqs, cfg.n_ssm_head, cfg.ssm_head_dim, cfg.d_state),
            )
            for il, (r, s) in rows.items()
        }
        x = self.embedding[tokens]  # [Bs, d_model]
        twin = partial(self._chains_logits, x, ubatch, states, views)
        logits = hybrid_native.decode(self._native_step(), x, ubatch, states, views, None, twin)
        for il, (window, h_rows) in views.items():
            states.write_states(il, window, h_rows)
        return logits

    def _native_step(self) -> hybrid_native.HybridNativeStep:
        """The C++ step over this model's blocks, built at its first use."""
        if self._native is None:
            mat = partial(one_operand, self.held)
            blocks = []
            for il, ly in enumerate(self.layers):
                if ly.mixer is not None:
                    mx = ly.mixer
                    tensors: tuple[Any, ...] = (
                        ly.norm, mat(mx.in_proj), mx.conv_weight, mx.conv_bias, mx.dt_bias, mx.A, mx.D,
                        mx.ssm_norm, mat(mx.out_proj), None, None,
                    )  # fmt: skip
                    blocks.append(NativeBlock(hybrid_native.MAMBA2, il, tensors))
                elif ly.attention is not None:
                    att = ly.attention
                    assert att.wqkv_t is not None and att.wo_t is not None
                    tensors = (ly.norm, mat(att.wqkv_t), None, None, mat(att.wo_t), None, None)
                    heads = (att.n_head, att.n_head_kv)
                    blocks.append(NativeBlock(hybrid_native.ATTENTION, il, tensors, heads, att.scale))
                else:
                    assert ly.ffn_up is not None and ly.ffn_down is not None
                    tensors = (ly.norm, mat(ly.ffn_up), mat(ly.ffn_down))
                    blocks.append(NativeBlock(hybrid_native.RELU2, il, tensors))
            head = one_operand(self.held, self.lm_head)
            cfg = self.config
            self._native = hybrid_native.HybridNativeStep(blocks, self.norm_f, head, cfg.n_group, cfg.eps)
        return self._native

    def _chains_logits(
        self,
        x: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        views: Mapping[int, tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """The decode step as compiled chains between the attention layers (:mod:`rsmem.models.hybrid.chains`:
        one sequence's blocks stream ``[out, in]`` rows, several sequences' the few-row kernel's operands);
        attention's KV part is eager; the ``views`` (window, h) are updated in place."""
        cfg = self.config
        many = x.shape[0] > 1
        mat = partial(many_operand if many else one_operand, self.held)
        if many:
            mamba, mlp, attn_out = self._mamba_many, self._mlp_many, self._attn_out_many
        else:
            mamba, mlp, attn_out = self._mamba, self._mlp, self._attn_out
        steps: list[Step | AttentionStep] = []
        for il, ly in enumerate(self.layers):
            if ly.mixer is not None:
                mx = ly.mixer
                tensors = (
                    ly.norm, mat(mx.in_proj), mx.conv_weight, mx.conv_bias, mx.dt_bias, mx.A, mx.D,
                    mx.ssm_norm, mat(mx.out_proj), *views[il],
                )  # fmt: skip
                steps.append(Step(mamba, tensors))
            elif ly.attention is not None:
                att = ly.attention
                assert att.wqkv_t is not None and att.wo_t is not None
                attn_in = (ly.norm, mat(att.wqkv_t), None, None, None, None)
                consts = (att.n_head, att.n_head_kv, cfg.eps)
                steps.append(AttentionStep(il, attn_in, consts, att.scale, attn_out, (mat(att.wo_t),)))
            else:
                assert ly.ffn_up is not None and ly.ffn_down is not None
                steps.append(Step(mlp, (ly.norm, mat(ly.ffn_up), mat(ly.ffn_down))))

        def attend(il: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
            return states.attention(il, q, k, v, scale, ubatch)

        if many:
            h = self._chains_many.run(x, steps, "norm", (self.norm_f,), cfg.eps, attend)
            return many_head(self.held, output_rows(h, ubatch.output_rows()), self.lm_head)
        head = one_operand(self.held, self.lm_head)
        logits = self._chains.run(x, steps, "head", (self.norm_f, head), cfg.eps, attend)
        return logits[: len(ubatch.output_rows())]
