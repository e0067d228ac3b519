"""Mamba (Gu & Dao 2023) on rsmem's recurrent memory, with llama.cpp's state rows.

Per layer: ``x + out_proj(gate(scan(silu(conv(in_x))), silu(z)))`` over ``rms_norm(x)``. States per sequence:
``r`` = the conv window ``[d_inner, d_conv-1]`` (oldest column first), ``s`` = the SSM state
``[d_inner, d_state]`` -- llama.cpp's ggml ``[d_conv-1, d_inner]`` and ``[d_state, d_inner]`` rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.models.ops.common import linear, output_rows, transposed
from rsmem.models.ops.conv import causal_conv1d
from rsmem.models.ops.norm import rms_norm
from rsmem.models.ops.selective_scan import selective_scan
from rsmem.models.protocol import StateAccess


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
    in_proj: torch.Tensor  # [2 * d_inner, d_model]: x, then z
    conv_weight: torch.Tensor  # [d_inner, d_conv]
    conv_bias: torch.Tensor  # [d_inner]
    x_proj: torch.Tensor  # [dt_rank + 2 * d_state, d_inner]: dt, B, C
    dt_proj: torch.Tensor  # [d_inner, dt_rank]
    dt_bias: torch.Tensor  # [d_inner]
    A: torch.Tensor  # [d_inner, d_state]
    D: torch.Tensor  # [d_inner]
    out_proj: torch.Tensor  # [d_model, d_inner]


@dataclass(slots=True)
class MambaWeights:
    embedding: torch.Tensor  # [n_vocab, d_model]
    layers: list[MambaLayer]
    norm_f: torch.Tensor  # [d_model]
    lm_head: torch.Tensor  # [n_vocab, d_model]; the embedding itself when tied


# held transposed, [in, out], in the compute dtype; the rest is small and stays float32 [out, in]
MATRICES = ("in_proj", "x_proj", "out_proj")


class MambaModel:
    """A Mamba language model implementing :class:`~rsmem.models.protocol.RecurrentModel`.

    Matrices are kept in ``dtype`` (float32 or bfloat16); norms, conv, ``A``, ``D`` and the scan stay
    float32, as do the residual stream and the states.
    """

    arch = "mamba"

    def __init__(self, config: MambaConfig, weights: MambaWeights, *, dtype: torch.dtype = torch.float32):
        self.config = config
        self.dtype = dtype
        self.n_vocab = config.n_vocab
        self.n_layer = config.n_layer
        self.n_embd_r = (config.d_conv - 1) * config.d_inner
        self.n_embd_s = config.d_state * config.d_inner
        self.tokenizer = None  # set by the loaders when the file carries one
        f32 = torch.float32
        self.embedding = weights.embedding.to(f32)
        self.norm_f = weights.norm_f.to(f32)
        tied = weights.lm_head is weights.embedding
        # transposed copies [in, out] (see ops.common.linear); a tied head costs one extra copy
        self.lm_head = transposed(weights.embedding if tied else weights.lm_head, dtype)
        self.layers = [
            MambaLayer(
                **{
                    name: transposed(getattr(layer, name), dtype)
                    if name in MATRICES
                    else getattr(layer, name).to(f32).contiguous()
                    for name in MambaLayer.__slots__
                }
            )
            for layer in weights.layers
        ]

    def is_recurrent_layer(self, il: int) -> bool:
        return True

    def forward(self, ubatch: UBatch, states: StateAccess) -> torch.Tensor:
        cfg = self.config
        tokens = ubatch.token_tensor()  # [Bs, L]
        n_seqs = tokens.shape[0]
        x = self.embedding[tokens]  # [Bs, L, d_model]
        for il, layer in enumerate(self.layers):
            r, s = states.read_states(il)
            window = r.view(n_seqs, cfg.d_inner, cfg.d_conv - 1).float()
            h = s.view(n_seqs, cfg.d_inner, cfg.d_state).float()
            out, window, h = self.mixer(layer, rms_norm(x, layer.norm, cfg.eps), window, h)
            states.write_states(il, window, h)
            x = x + out
        x = output_rows(x, ubatch.output_rows())
        return linear(rms_norm(x, self.norm_f, cfg.eps), self.lm_head).float()

    def mixer(
        self, layer: MambaLayer, u: torch.Tensor, window: torch.Tensor, h: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The selective SSM block over ``u`` ``[Bs, L, d_model]``; returns ``(out, window, h)``."""
        cfg = self.config
        xz = linear(u, layer.in_proj)
        xs, z = xz.split(cfg.d_inner, dim=-1)
        xc, window = causal_conv1d(xs, window, layer.conv_weight, layer.conv_bias)
        xc = F.silu(xc)
        dt_low, B, C = linear(xc, layer.x_proj).split([cfg.dt_rank, cfg.d_state, cfg.d_state], dim=-1)
        dt = F.softplus(F.linear(dt_low, layer.dt_proj, layer.dt_bias))
        y, h = selective_scan(xc, dt, layer.A, B.contiguous(), C.contiguous(), layer.D, h)
        return linear(y * F.silu(z), layer.out_proj), window, h
