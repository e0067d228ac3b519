"""Mamba (Gu & Dao 2023) on rsmem's recurrent memory, with llama.cpp's state rows.

Per layer: ``x + out_proj(gate(scan(silu(conv(in_x))), silu(z)))`` over ``rms_norm(x)``. States per sequence:
``r`` = the conv window ``[d_inner, d_conv-1]`` (oldest column first), ``s`` = the SSM state
``[d_inner, d_state]`` -- llama.cpp's ggml ``[d_conv-1, d_inner]`` and ``[d_state, d_inner]`` rows.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.models.mamba.base import MambaFamilyModel
from rsmem.models.ops.common import CapturePoints
from rsmem.models.ops.conv import causal_conv1d_, conv_windows_at
from rsmem.models.ops.quantized import Matrix
from rsmem.models.ops.selective_scan import selective_scan_at_
from rsmem.models.step.compiled import CompiledStep, CompileSetting
from rsmem.models.step.fused import (
    mamba_layer_many_,
    mamba_layer_one_,
    mamba_scan_block,
    selective_scan_blocked_at_,
    token_step,
)
from rsmem.models.step.native import NativeStep
from rsmem.models.step.operands import MAMBA


@dataclass(frozen=True, slots=True)
class MambaConfig:
    """Hyperparameters; ``d_inner`` 0 means ``2 * d_model`` and ``dt_rank`` 0 means ``ceil(d_model / 16)``,
    the defaults of the reference implementation."""

    d_model: int
    n_layer: int
    n_vocab: int
    d_state: int = 16
    d_conv: int = 4
    d_inner: int = 0
    dt_rank: int = 0
    eps: float = 1e-5

    def __post_init__(self) -> None:
        if self.d_inner == 0:
            object.__setattr__(self, "d_inner", 2 * self.d_model)
        if self.dt_rank == 0:
            object.__setattr__(self, "dt_rank", math.ceil(self.d_model / 16))
        if min(self.d_model, self.n_layer, self.n_vocab, self.d_state, self.d_conv) < 1:
            raise ValueError(f"invalid Mamba config {self}")


@dataclass(slots=True)
class MambaLayer:
    """One block's weights, as llama.cpp stores them (``A`` is ``-exp(A_log)``; conv kernel squeezed)."""

    norm: torch.Tensor  # [d_model]
    in_proj: Matrix  # [2 * d_inner, d_model]: x, then z
    conv_weight: torch.Tensor  # [d_inner, d_conv]
    conv_bias: torch.Tensor  # [d_inner]
    x_proj: Matrix  # [dt_rank + 2 * d_state, d_inner]: dt, B, C
    dt_proj: torch.Tensor  # [d_inner, dt_rank]
    dt_bias: torch.Tensor  # [d_inner]
    A: torch.Tensor  # [d_inner, d_state]
    D: torch.Tensor  # [d_inner]
    out_proj: Matrix  # [d_model, d_inner]


@dataclass(slots=True)
class MambaWeights:
    embedding: Matrix  # [n_vocab, d_model]
    layers: list[MambaLayer]
    norm_f: torch.Tensor  # [d_model]
    lm_head: Matrix  # [n_vocab, d_model]; the embedding itself when tied


class MambaModel(MambaFamilyModel):
    """A Mamba language model implementing :class:`~rsmem.models.protocol.RecurrentModel`.

    Matrices are kept in ``dtype`` (float32 or bfloat16); norms, conv, ``A``, ``D`` and the scan stay
    float32, as do the residual stream and the states.
    """

    arch = "mamba"
    matrices = MAMBA.matrices

    def __init__(
        self,
        config: MambaConfig,
        weights: MambaWeights,
        *,
        dtype: torch.dtype = torch.float32,
        compile: CompileSetting = None,
    ):
        super().__init__(
            config,
            weights,
            dtype=dtype,
            compile=compile,
            conv_channels=config.d_inner,
            state_shape=(config.d_inner, config.d_state),
        )

    def mixer(
        self,
        layer: MambaLayer,
        u: torch.Tensor,
        window: torch.Tensor,
        h: torch.Tensor,
        at: CapturePoints = (),
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The selective SSM block over ``u`` ``[Bs, L, d_model]``; updates ``window`` and ``h`` in place
        (and returns their values after the points ``at``, see the base class)."""
        cfg = self.config
        xs, z = self.linear(u, layer.in_proj).split(cfg.d_inner, dim=-1)
        windows_at = conv_windows_at(window, xs, at) if at else None  # before the conv moves the window
        xc = F.silu(causal_conv1d_(xs, window, layer.conv_weight, layer.conv_bias))
        dt_low, B, C = self.linear(xc, layer.x_proj).split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        dt = F.softplus(F.linear(dt_low, layer.dt_proj, layer.dt_bias))
        if self.compile_decode and xc.shape[1] > 1:  # compiled blocks of the sequential scan
            block = self._scan_block_one if xc.shape[0] == 1 else self._scan_block_many
            y, h_at = selective_scan_blocked_at_(xc, dt, layer.A, B, C, layer.D, h, at, block)
        else:
            y, h_at = selective_scan_at_(xc, dt, layer.A, B, C, layer.D, h, at)
        out = self.linear(y.mul_(F.silu(z)), layer.out_proj)
        return out, None if windows_at is None else (windows_at, h_at)

    def make_compiled_steps(self) -> None:
        self._scan_block_one = CompiledStep(mamba_scan_block)
        self._scan_block_many = CompiledStep(mamba_scan_block, batch_args=(0, 1, 2, 4, 5))

    def layer_one(self) -> tuple[Callable[..., torch.Tensor], int, tuple[float | int, ...]]:
        return mamba_layer_one_, MAMBA.n_fields, (self.config.eps, self.config.dt_rank, self.config.d_state)

    def layer_many(self) -> Callable[..., torch.Tensor]:
        return mamba_layer_many_

    def native_step(self) -> NativeStep:
        layer_fn, n_fields, consts = self.layer_one()
        return NativeStep("mamba_step", token_step(layer_fn, n_fields, consts), MAMBA, consts)

    def layer_args(self, layer: MambaLayer, operand: Callable[[Matrix], Any]) -> tuple[Any, ...]:
        return MAMBA.of(layer, operand)
