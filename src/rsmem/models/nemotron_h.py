"""Nemotron-H (dense) on rsmem's hybrid memory, computed as llama.cpp's ``nemotron_h`` graph.

Every layer is ``x += block(rms_norm(x))`` with one of three blocks: a Mamba-2 mixer (its conv window and
SSM state in the recurrent memory, llama.cpp's Mamba-2 rows), grouped-query attention without RoPE (keys
and values in the KV cache; the GGUF's q/k rows carry LLaMA's permutation, which leaves attention
unchanged), or a squared-ReLU MLP (no memory at all). Then RMS norm and the LM head. Eager float32, with
Mamba-2's kernels from :mod:`rsmem.models.ops`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.lfm2 import Attention, HybridStates
from rsmem.models.ops.common import output_rows
from rsmem.models.ops.conv import causal_conv1d_
from rsmem.models.ops.norm import gated_group_rms_norm, rms_norm
from rsmem.models.ops.ssd import ssd_chunked_
from rsmem.models.protocol import StateAccess

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
    """A Nemotron-H language model for a :class:`~rsmem.memory.hybrid.HybridMemory` (float32, eager)."""

    arch = "nemotron_h"
    compile_decode = False

    def __init__(self, config: NemotronHConfig, weights: NemotronHWeights) -> None:
        cfg = config
        self.config = cfg
        self.n_vocab = cfg.n_vocab
        self.n_layer = cfg.n_layer
        self.n_embd_r = (cfg.d_conv - 1) * cfg.conv_dim
        self.n_embd_s = cfg.d_state * cfg.d_inner
        self.tokenizer: Tokenizer | None = None
        self.embedding = weights.embedding.float().contiguous()
        self.norm_f = weights.norm_f.float()
        self.lm_head = weights.lm_head.float().contiguous()
        self.layers = weights.layers
        self.kv_layers: Mapping[int, tuple[int, int]] = {
            il: (n * cfg.head_dim, n * cfg.head_dim)
            for il, n in enumerate(cfg.n_head_kv)
            if cfg.kinds[il] == ATTENTION
        }

    def is_recurrent_layer(self, il: int) -> bool:
        return self.config.kinds[il] == MAMBA

    def k_shift(self, il: int, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        return rows  # no RoPE: keys do not depend on positions

    def set_compile(self, setting: object) -> bool:
        return False

    def warm_up(self) -> float:
        return 0.0

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        """Logits of the micro-batch's output tokens; ``states`` must be a hybrid memory's context."""
        hybrid = cast(HybridStates, states)  # RecurrentModel's signature; attention needs HybridStates
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        x = self.embedding[tokens]
        for il, ly in enumerate(self.layers):
            h = rms_norm(x, ly.norm, cfg.eps)
            if ly.mixer is not None:
                x = x + self.mamba2(il, ly.mixer, h, hybrid)
            elif ly.attention is not None:
                x = x + ly.attention.forward(il, h, ubatch, hybrid, cfg.eps)
            else:
                assert ly.ffn_up is not None and ly.ffn_down is not None
                x = x + F.linear(torch.relu(F.linear(h, ly.ffn_up)).square(), ly.ffn_down)
        x = output_rows(x, ubatch.output_rows())
        return F.linear(rms_norm(x, self.norm_f, cfg.eps), self.lm_head)

    def mamba2(self, il: int, mx: Mamba2Mixer, u: torch.Tensor, states: HybridStates) -> torch.Tensor:
        """Mamba-2's SSD block over ``u`` ``[Bs, L, d_model]`` from the layer's states, which it updates."""
        cfg = self.config
        n_seqs, n_tokens, _ = u.shape
        r, s = states.read_states(il)
        window = r.view(n_seqs, cfg.conv_dim, cfg.d_conv - 1).float()
        h = s.view(n_seqs, cfg.n_ssm_head, cfg.ssm_head_dim, cfg.d_state).float()
        z, xbc, dt = F.linear(u, mx.in_proj).split([cfg.d_inner, cfg.conv_dim, cfg.n_ssm_head], dim=-1)
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
        return F.linear(y, mx.out_proj)
