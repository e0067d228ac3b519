"""Random-weight models of a given size: for benchmarks and tests, never for text."""

from __future__ import annotations

import math

import torch

from rsmem.models.mamba.mamba1 import MambaConfig, MambaLayer, MambaModel, MambaWeights
from rsmem.models.mamba.mamba2 import Mamba2Config, Mamba2Layer, Mamba2Model, Mamba2Weights


def _normal(g: torch.Generator, *shape: int, fan_in: int | None = None) -> torch.Tensor:
    std = 1.0 / math.sqrt(fan_in) if fan_in else 0.02
    return torch.randn(*shape, generator=g) * std


def _decay(g: torch.Generator, *shape: int) -> torch.Tensor:
    """``A = -exp(A_log)`` with ``A_log`` in the usual ``log(1..16)`` range."""
    return -torch.exp(torch.rand(*shape, generator=g) * math.log(16))


def random_mamba(config: MambaConfig, seed: int = 0, dtype: torch.dtype = torch.float32) -> MambaModel:
    g = torch.Generator().manual_seed(seed)
    c = config
    layers = [
        MambaLayer(
            norm=torch.ones(c.d_model),
            in_proj=_normal(g, 2 * c.d_inner, c.d_model, fan_in=c.d_model),
            conv_weight=_normal(g, c.d_inner, c.d_conv, fan_in=c.d_conv),
            conv_bias=_normal(g, c.d_inner),
            x_proj=_normal(g, c.dt_rank + 2 * c.d_state, c.d_inner, fan_in=c.d_inner),
            dt_proj=_normal(g, c.d_inner, c.dt_rank, fan_in=c.dt_rank),
            dt_bias=torch.full((c.d_inner,), -4.0),
            A=_decay(g, c.d_inner, c.d_state),
            D=torch.ones(c.d_inner),
            out_proj=_normal(g, c.d_model, c.d_inner, fan_in=c.d_inner),
        )
        for _ in range(c.n_layer)
    ]
    embedding = _normal(g, c.n_vocab, c.d_model)
    return MambaModel(c, MambaWeights(embedding, layers, torch.ones(c.d_model), embedding), dtype=dtype)


def random_mamba2(config: Mamba2Config, seed: int = 0, dtype: torch.dtype = torch.float32) -> Mamba2Model:
    g = torch.Generator().manual_seed(seed)
    c = config
    layers = [
        Mamba2Layer(
            norm=torch.ones(c.d_model),
            in_proj=_normal(g, c.d_inner + c.conv_dim + c.n_head, c.d_model, fan_in=c.d_model),
            conv_weight=_normal(g, c.conv_dim, c.d_conv, fan_in=c.d_conv),
            conv_bias=_normal(g, c.conv_dim),
            dt_bias=torch.full((c.n_head,), -4.0),
            A=_decay(g, c.n_head),
            D=torch.ones(c.n_head),
            ssm_norm=torch.ones(c.d_inner),
            out_proj=_normal(g, c.d_model, c.d_inner, fan_in=c.d_inner),
        )
        for _ in range(c.n_layer)
    ]
    embedding = _normal(g, c.n_vocab, c.d_model)
    return Mamba2Model(c, Mamba2Weights(embedding, layers, torch.ones(c.d_model), embedding), dtype=dtype)


def mamba_130m(seed: int = 0) -> MambaModel:
    """The size of state-spaces/mamba-130m: d_model 768, 24 layers, vocab 50280."""
    return random_mamba(MambaConfig(d_model=768, n_layer=24, n_vocab=50280), seed)


def mamba2_130m(seed: int = 0) -> Mamba2Model:
    """The size of mamba2-130m: d_model 768, 24 layers, d_state 128, head_dim 64."""
    return random_mamba2(Mamba2Config(d_model=768, n_layer=24, n_vocab=50280, d_state=128), seed)
