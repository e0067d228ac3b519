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

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.hybrid import native as hybrid_native
from rsmem.models.hybrid.base import HybridModelBase, Operand, StateFills, attention_step, native_attention
from rsmem.models.hybrid.chains import AttentionStep, Chains, Step
from rsmem.models.hybrid.layers import Attention, HybridStates, RopeTables
from rsmem.models.hybrid.native import NativeBlock
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.norm import gated_group_rms_norm, rms_norm
from rsmem.models.ops.ssd import ssd_chunked_
from rsmem.models.step.compiled import CompileSetting
from rsmem.models.step.fused import mamba2_layer_many_, mamba2_layer_one_
from rsmem.models.step.hybrid_fused import (
    Block,
    attn_out_many,
    attn_out_one,
    relu2_mlp_many,
    relu2_mlp_one,
)

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


class NemotronHModel(HybridModelBase[Chains]):
    """A Nemotron-H language model for a :class:`~rsmem.memory.hybrid.HybridMemory`. After construction
    the layers' matrices are the ``[in, out]`` tensors of
    :class:`~rsmem.models.hybrid.layers.HeldMatrices`."""

    arch = "nemotron_h"
    config: NemotronHConfig
    layers: list[NemotronHLayer]

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
        kv_widths = [
            n * cfg.head_dim if kind == ATTENTION else 0 for kind, n in zip(cfg.kinds, cfg.n_head_kv)
        ]
        super().__init__(
            cfg,
            weights,
            dtype=dtype,
            compile=compile,
            n_embd_r=(cfg.d_conv - 1) * cfg.conv_dim,
            n_embd_s=cfg.d_state * cfg.d_inner,
            kv_widths=kv_widths,
        )

    def layer_matrices(self, ly: NemotronHLayer) -> list[torch.Tensor]:
        """The layer's ``[out, in]`` matrices to hold."""
        if ly.mixer is not None:
            return [ly.mixer.in_proj.float(), ly.mixer.out_proj.float()]
        if ly.attention is not None:
            return ly.attention.matrices()
        assert ly.ffn_up is not None and ly.ffn_down is not None
        return [ly.ffn_up.float(), ly.ffn_down.float()]

    def set_layer(self, ly: NemotronHLayer, held: list[torch.Tensor]) -> None:
        """Use the held (``[in, out]``) :meth:`layer_matrices`; vectors float32."""
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

    @property
    def native_groups(self) -> int:
        return self.config.n_group

    def new_chains(self) -> tuple[Chains, Chains]:
        """The chains of one sequence and of one token of each of several (and the blocks they run)."""
        cfg = self.config
        self._mamba = Block(mamba2_layer_one_, 11, (cfg.n_group, cfg.eps), mutated=(9, 10))  # window, h
        self._mlp = Block(relu2_mlp_one, 3, (cfg.eps,))
        self._attn_out = Block(attn_out_one, 2)  # o, wo
        self._mamba_many = Block(mamba2_layer_many_, 11, (cfg.n_group, cfg.eps), mutated=(9, 10))
        self._mlp_many = Block(relu2_mlp_many, 3, (cfg.eps,))
        self._attn_out_many = Block(attn_out_many, 2, batch=(0,))  # o: one row a sequence
        return Chains(), Chains(many=True)

    def layer_forward(
        self,
        il: int,
        ly: NemotronHLayer,
        x: torch.Tensor,
        ubatch: UBatch,
        states: HybridStates,
        rope: RopeTables | None,
    ) -> torch.Tensor:
        """``x += block(rms_norm(x))``: Mamba-2, attention (no RoPE: ``rope`` is None) or the MLP."""
        linear = self.held.linear
        h = rms_norm(x, ly.norm, self.config.eps)
        if ly.mixer is not None:
            return x + self.mamba2(il, ly.mixer, h, states)
        if ly.attention is not None:
            return x + ly.attention.forward(il, h, ubatch, states, self.config.eps, rope)
        assert ly.ffn_up is not None and ly.ffn_down is not None
        return x + linear(torch.relu(linear(h, ly.ffn_up)).square(), ly.ffn_down)

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

    def state_views(self, r: torch.Tensor, s: torch.Tensor, n_seqs: int) -> tuple[torch.Tensor, ...]:
        """Mamba-2's conv window ``[Bs, conv_dim, d_conv - 1]`` and SSM state ``[Bs, H, P, N]``."""
        cfg = self.config
        return (
            r.view(n_seqs, cfg.conv_dim, cfg.d_conv - 1),
            s.view(n_seqs, cfg.n_ssm_head, cfg.ssm_head_dim, cfg.d_state),
        )

    @staticmethod
    def _mixer_tensors(ly: NemotronHLayer, mat: Operand) -> tuple[Any, ...]:
        """A Mamba-2 layer's tensors for its block (C++ op's or chain's), but for the window and ``h`` that
        end them."""
        mx = ly.mixer
        assert mx is not None
        return (
            ly.norm, mat(mx.in_proj), mx.conv_weight, mx.conv_bias, mx.dt_bias, mx.A, mx.D, mx.ssm_norm,
            mat(mx.out_proj),
        )  # fmt: skip

    def native_blocks(self, mat: Operand) -> list[NativeBlock]:
        blocks = []
        for il, ly in enumerate(self.layers):
            if ly.mixer is not None:
                tensors = (*self._mixer_tensors(ly, mat), None, None)
                blocks.append(NativeBlock(hybrid_native.MAMBA2, il, tensors))
            elif ly.attention is not None:
                blocks.append(native_attention(il, ly.norm, ly.attention, mat))
            else:
                assert ly.ffn_up is not None and ly.ffn_down is not None
                tensors = (ly.norm, mat(ly.ffn_up), mat(ly.ffn_down))
                blocks.append(NativeBlock(hybrid_native.RELU2, il, tensors))
        return blocks

    def chain_steps(
        self, mat: Operand, many: bool, fills: StateFills, rope: RopeTables | None
    ) -> list[Step | AttentionStep]:
        """A Mamba-2 layer's block takes its window and ``h`` from ``fills`` (updated in place)."""
        if many:
            mamba, mlp, attn_out = self._mamba_many, self._mlp_many, self._attn_out_many
        else:
            mamba, mlp, attn_out = self._mamba, self._mlp, self._attn_out
        steps: list[Step | AttentionStep] = []
        for il, ly in enumerate(self.layers):
            if ly.mixer is not None:
                steps.append(Step(mamba, (*self._mixer_tensors(ly, mat), *fills[il])))
            elif ly.attention is not None:
                steps.append(attention_step(il, ly.norm, ly.attention, mat, rope, self.config.eps, attn_out))
            else:
                assert ly.ffn_up is not None and ly.ffn_down is not None
                steps.append(Step(mlp, (ly.norm, mat(ly.ffn_up), mat(ly.ffn_down))))
        return steps
