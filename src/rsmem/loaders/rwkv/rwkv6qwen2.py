"""QRWKV-6 GGUF files (llama.cpp's ``rwkv6qwen2``): hyperparameters from ``rwkv6qwen2.*`` keys and the
weights by llama.cpp's tensor names (as its ``llama_model_rwkv6qwen2::load_arch_tensors`` creates them).

``rwkv6qwen2_config(keys, n_vocab)`` and ``build_rwkv6qwen2(ckpt, dtype, compile)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.keys import ArchKeys, LayerTensors, consistent, rwkv6_time_mix
from rsmem.loaders.tensors import tensor_name as name
from rsmem.models.rwkv.base import RmsBodyWeights
from rsmem.models.rwkv.rwkv6qwen2 import Rwkv6Qwen2Config, Rwkv6Qwen2Layer, Rwkv6Qwen2Model
from rsmem.models.step.compiled import CompileSetting

if TYPE_CHECKING:
    from rsmem.loaders.tensors import ModelTensors

T = gguf.MODEL_TENSOR


def rwkv6qwen2_config(keys: ArchKeys, n_vocab: int) -> Rwkv6Qwen2Config:
    """From ``rwkv6qwen2.*`` metadata."""
    keys.token_shift(1)
    eps = keys.float_or("attention.layer_norm_rms_epsilon", 1e-6)
    body = keys.body()
    n_head_kv = 0  # absent: as many as the heads
    if keys.optional("attention.head_count_kv") is not None:
        kv = keys.counts("attention.head_count_kv", body["n_layer"], 1)
        if len(set(kv)) != 1:
            raise ModelFormatError(f"rwkv6qwen2 with per-layer key/value head counts {kv} is not supported")
        n_head_kv = kv[0]
        n_head = body["d_model"] // body["head_size"]
        if n_head % n_head_kv:
            raise keys.error(
                "attention.head_count_kv",
                f"is {n_head_kv}, not a divisor of the {n_head} heads (embedding_length / wkv.head_size)",
            )
    with consistent():
        return Rwkv6Qwen2Config(**body, **keys.v6_extra(), n_vocab=n_vocab, eps=eps, n_head_kv=n_head_kv)


def build_rwkv6qwen2(ckpt: ModelTensors, dtype: torch.dtype, compile: CompileSetting) -> Rwkv6Qwen2Model:
    cfg = ckpt.config
    assert isinstance(cfg, Rwkv6Qwen2Config)
    d, f, e, de = cfg.d_model, cfg.d_ff, cfg.time_mix_extra_dim, cfg.time_decay_extra_dim
    if cfg.n_head % cfg.kv_heads:
        raise ModelFormatError(
            f"{ckpt.source}: {cfg.n_head} heads do not share {cfg.kv_heads} key/value heads"
        )
    dkv = cfg.kv_heads * cfg.head_size
    layers = []
    for b in range(cfg.n_layer):
        t = LayerTensors(ckpt, b)
        get, bias = t.get, t.bias
        if t.has(T.TIME_MIX_FIRST):
            raise ModelFormatError(
                f"{ckpt.source}: rwkv6qwen2 with time_mix_first (RWKV-6's bonus, layer {b}) is not supported"
            )
        layers.append(
            Rwkv6Qwen2Layer(
                attn_norm=get(T.ATTN_NORM, (d,)),
                **rwkv6_time_mix(t, d, e, de),
                key=get(T.TIME_MIX_KEY, (dkv, d)),
                value=get(T.TIME_MIX_VALUE, (dkv, d)),
                ffn_norm=get(T.FFN_NORM, (d,)),
                ffn_gate=get(T.FFN_GATE, (f, d)),
                ffn_up=get(T.FFN_UP, (f, d)),
                ffn_down=get(T.FFN_DOWN, (d, f)),
                receptance_b=bias(T.TIME_MIX_RECEPTANCE, d),
                key_b=bias(T.TIME_MIX_KEY, dkv),
                value_b=bias(T.TIME_MIX_VALUE, dkv),
            )
        )
    weights = RmsBodyWeights(
        embedding=ckpt.get(name(T.TOKEN_EMBD), (cfg.n_vocab, d)),
        layers=layers,
        norm_f=ckpt.get(name(T.OUTPUT_NORM), (d,)),
        lm_head=ckpt.get(name(T.OUTPUT), (cfg.n_vocab, d)),
    )
    return Rwkv6Qwen2Model(cfg, weights, dtype=dtype, compile=compile)
