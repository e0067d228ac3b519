"""Mamba-2 (Dao & Gu 2024) on rsmem's recurrent memory, with llama.cpp's state rows.

Per layer: ``in_proj`` gives ``z``, ``xBC`` and ``dt``; ``xBC`` goes through the causal conv and SiLU, the SSD
scan runs per head, and the output is gated by ``z`` and RMS-normalised per group before ``out_proj``.
States per sequence: ``r`` = the conv window of the ``xBC`` channels ``[conv_dim, d_conv-1]``, ``s`` = the
SSM state ``[n_head, head_dim, d_state]`` (ggml ``[d_conv-1, conv_dim]`` and ``[d_state, head_dim, n_head]``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.models.mamba.base import MambaFamilyModel
from rsmem.models.ops.common import CapturePoints
from rsmem.models.ops.conv import causal_conv1d_, conv_windows_at
from rsmem.models.ops.norm import gated_group_rms_norm
from rsmem.models.ops.quantized import Matrix
from rsmem.models.ops.ssd import ssd_chunked_at_
from rsmem.models.step.compiled import GLUE_MIN_CHUNK, CompileSetting
from rsmem.models.step.fused import mamba2_layer_many_, mamba2_layer_one_, token_step
from rsmem.models.step.native import NativeStep
from rsmem.models.step.operands import MAMBA2


@dataclass(frozen=True, slots=True)
class Mamba2Config:
    """Hyperparameters; ``d_inner`` 0 means ``2 * d_model``, ``n_head`` 0 means ``d_inner / 64``."""

    d_model: int
    n_layer: int
    n_vocab: int
    d_state: int = 128
    d_conv: int = 4
    d_inner: int = 0
    n_head: int = 0
    n_group: int = 1
    eps: float = 1e-5
    chunk_size: int = 64  # SSD chunk length for prefill

    def __post_init__(self) -> None:
        if self.d_inner == 0:
            object.__setattr__(self, "d_inner", 2 * self.d_model)
        if self.n_head == 0:
            object.__setattr__(self, "n_head", self.d_inner // 64)
        if self.n_head < 1 or self.d_inner % self.n_head or self.n_head % self.n_group:
            raise ValueError(f"d_inner must split into heads and heads into groups: {self}")
        if self.d_inner % self.n_group:
            raise ValueError(f"d_inner must split into n_group norm groups: {self}")

    @property
    def head_dim(self) -> int:
        return self.d_inner // self.n_head

    @property
    def conv_dim(self) -> int:
        """Channels of ``xBC``: ``x``, then ``B`` and ``C`` for each group."""
        return self.d_inner + 2 * self.n_group * self.d_state


@dataclass(slots=True)
class Mamba2Layer:
    norm: torch.Tensor  # [d_model]
    in_proj: Matrix  # [d_inner + conv_dim + n_head, d_model]: z, xBC, dt
    conv_weight: torch.Tensor  # [conv_dim, d_conv]
    conv_bias: torch.Tensor  # [conv_dim]
    dt_bias: torch.Tensor  # [n_head]
    A: torch.Tensor  # [n_head], -exp(A_log)
    D: torch.Tensor  # [n_head]
    ssm_norm: torch.Tensor  # [d_inner]
    out_proj: Matrix  # [d_model, d_inner]


@dataclass(slots=True)
class Mamba2Weights:
    embedding: Matrix  # [n_vocab, d_model]
    layers: list[Mamba2Layer]
    norm_f: torch.Tensor
    lm_head: Matrix  # the embedding itself when tied


class Mamba2Model(MambaFamilyModel):
    """A Mamba-2 language model implementing :class:`~rsmem.models.protocol.RecurrentModel`."""

    arch = "mamba2"
    matrices = MAMBA2.matrices
    # the glue on the calling thread: a loaded server gains, and no decode loses. Mamba keeps inductor's
    # default: with this threshold its batched scan kernels would run on one thread and its wide steps slow
    glue_min_chunk = GLUE_MIN_CHUNK

    def __init__(
        self,
        config: Mamba2Config,
        weights: Mamba2Weights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ):
        super().__init__(
            config,
            weights,
            dtype=dtype,
            compile=compile,
            conv_channels=config.conv_dim,
            state_shape=(config.n_head, config.head_dim, config.d_state),
        )

    def mixer(
        self,
        layer: Mamba2Layer,
        u: torch.Tensor,
        window: torch.Tensor,
        h: torch.Tensor,
        at: CapturePoints = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The SSD block over ``u`` ``[Bs, L, d_model]``; updates ``window`` and ``h`` in place (and returns
        their values after the points ``at``, see the base class)."""
        cfg = self.config
        n_seqs, n_tokens, _ = u.shape
        z, xBC, dt = self.linear(u, layer.in_proj).split([cfg.d_inner, cfg.conv_dim, cfg.n_head], dim=-1)
        windows_at = conv_windows_at(window, xBC, at) if at else None  # before the conv moves the window
        xBC = F.silu(causal_conv1d_(xBC, window, layer.conv_weight, layer.conv_bias))
        gn = cfg.n_group * cfg.d_state
        x, B, C = xBC.split([cfg.d_inner, gn, gn], dim=-1)
        y, h_at = ssd_chunked_at_(
            x.reshape(n_seqs, n_tokens, cfg.n_head, cfg.head_dim),
            F.softplus(dt + layer.dt_bias),
            layer.A,
            B.reshape(n_seqs, n_tokens, cfg.n_group, cfg.d_state),
            C.reshape(n_seqs, n_tokens, cfg.n_group, cfg.d_state),
            layer.D,
            h,
            at,
            chunk_size=cfg.chunk_size,
        )
        y = gated_group_rms_norm(
            y.reshape(n_seqs, n_tokens, cfg.d_inner), z, layer.ssm_norm, cfg.n_group, cfg.eps
        )
        return self.linear(y, layer.out_proj), None if windows_at is None else (windows_at, h_at)

    def layer_one(self) -> tuple[Callable[..., torch.Tensor], int, tuple[float | int, ...]]:
        return mamba2_layer_one_, MAMBA2.n_fields, (self.config.n_group, self.config.eps)

    def layer_many(self) -> Callable[..., torch.Tensor]:
        return mamba2_layer_many_

    def native_step(self) -> NativeStep:
        layer_fn, n_fields, consts = self.layer_one()
        return NativeStep("mamba2_step", token_step(layer_fn, n_fields, consts), MAMBA2, consts)

    def layer_args(self, layer: Mamba2Layer, operand: Callable[[Matrix], Any]) -> tuple[Any, ...]:
        return MAMBA2.of(layer, operand)
