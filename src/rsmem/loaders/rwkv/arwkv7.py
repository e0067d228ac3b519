"""ARWKV-7 GGUF files (llama.cpp's ``arwkv7``): hyperparameters from ``arwkv7.*`` keys and the weights by
llama.cpp's tensor names (as its ``llama_model_arwkv7::load_arch_tensors`` creates them).

``arwkv7_config(keys, n_vocab)`` and ``build_arwkv7(ckpt, dtype, compile)``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.keys import ArchKeys, LayerTensors, consistent
from rsmem.loaders.tensors import tensor_name as name
from rsmem.models.rwkv.arwkv7 import Arwkv7Config, Arwkv7Layer, Arwkv7Model, Arwkv7Weights
from rsmem.models.step.compiled import CompileSetting

if TYPE_CHECKING:
    from rsmem.loaders.tensors import ModelTensors

T = gguf.MODEL_TENSOR


def arwkv7_config(keys: ArchKeys, n_vocab: int) -> Arwkv7Config:
    """From ``arwkv7.*`` metadata."""
    keys.token_shift(1)
    gate = keys.integer_or("attention.gate_lora_rank", 0)
    eps = keys.float_or("attention.layer_norm_rms_epsilon", 1e-6)
    with consistent():
        return Arwkv7Config(**keys.body(), **keys.v7_loras(), n_vocab=n_vocab, n_lora_gate=gate, eps=eps)


def build_arwkv7(ckpt: ModelTensors, dtype: torch.dtype, compile: CompileSetting) -> Arwkv7Model:
    cfg = ckpt.config
    assert isinstance(cfg, Arwkv7Config)
    d, f = cfg.d_model, cfg.d_ff
    layers = []
    for b in range(cfg.n_layer):
        t = LayerTensors(ckpt, b)
        get = t.get
        lerp = ckpt.tensors.get(name(T.TIME_MIX_LERP_FUSED, b))
        if lerp is None or lerp.numel() not in (5 * d, 6 * d):
            raise ModelFormatError(
                f"{ckpt.source}: {name(T.TIME_MIX_LERP_FUSED, b)} missing or not 5 or 6 x {d}"
            )
        layer = Arwkv7Layer(
            attn_norm=get(T.ATTN_NORM, (d,)),
            lerp=lerp.reshape(-1, d),
            w0=get(T.TIME_MIX_W0, (d,)),
            w1=get(T.TIME_MIX_W1, (cfg.n_lora_decay, d)),
            w2=get(T.TIME_MIX_W2, (d, cfg.n_lora_decay)),
            a0=get(T.TIME_MIX_A0, (d,)),
            a1=get(T.TIME_MIX_A1, (cfg.n_lora_iclr, d)),
            a2=get(T.TIME_MIX_A2, (d, cfg.n_lora_iclr)),
            k_k=get(T.TIME_MIX_K_K, (d,)),
            k_a=get(T.TIME_MIX_K_A, (d,)),
            r_k=get(T.TIME_MIX_R_K, (d,)),
            receptance=get(T.TIME_MIX_RECEPTANCE, (d, d)),
            key=get(T.TIME_MIX_KEY, (d, d)),
            value=get(T.TIME_MIX_VALUE, (d, d)),
            output=get(T.TIME_MIX_OUTPUT, (d, d)),
            ffn_norm=get(T.FFN_NORM, (d,)),
            ffn_gate=get(T.FFN_GATE, (f, d)),
            ffn_up=get(T.FFN_UP, (f, d)),
            ffn_down=get(T.FFN_DOWN, (d, f)),
        )
        if b > 0:  # the first layer's v0/v1/v2 are unused (llama.cpp loads them, never reads them)
            layer.v0 = get(T.TIME_MIX_V0, (d,))
            layer.v1 = get(T.TIME_MIX_V1, (cfg.n_lora_value_res_mix, d))
            layer.v2 = get(T.TIME_MIX_V2, (d, cfg.n_lora_value_res_mix))
        if t.has(T.TIME_MIX_G1) and t.has(T.TIME_MIX_G2):
            layer.g1 = get(T.TIME_MIX_G1, (cfg.n_lora_gate, d))
            layer.g2 = get(T.TIME_MIX_G2, (d, cfg.n_lora_gate))
        if t.has(T.TIME_MIX_LN) and t.has(T.TIME_MIX_LN, ".bias"):
            layer.ln_x, layer.ln_x_b = get(T.TIME_MIX_LN, (d,)), get(T.TIME_MIX_LN, (d,), ".bias")
        layers.append(layer)
    weights = Arwkv7Weights(
        embedding=ckpt.get(name(T.TOKEN_EMBD), (cfg.n_vocab, d)),
        layers=layers,
        norm_f=ckpt.get(name(T.OUTPUT_NORM), (d,)),
        lm_head=ckpt.get(name(T.OUTPUT), (cfg.n_vocab, d)),
    )
    return Arwkv7Model(cfg, weights, dtype=dtype, compile=compile)
