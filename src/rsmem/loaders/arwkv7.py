"""ARWKV-7 GGUF files (llama.cpp's ``arwkv7``): hyperparameters from ``arwkv7.*`` keys and the weights by
llama.cpp's tensor names (as its ``llama_model_arwkv7::load_arch_tensors`` creates them).

``arwkv7_config(key, n_vocab, optional)`` and ``build_arwkv7(ckpt, dtype, compile)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.checkpoint import metadata_int as _int
from rsmem.loaders.checkpoint import tensor_name as name
from rsmem.models.arwkv7 import Arwkv7Config, Arwkv7Layer, Arwkv7Model, Arwkv7Weights
from rsmem.models.compiled import CompileSetting

if TYPE_CHECKING:
    from rsmem.loaders.checkpoint import Checkpoint

T = gguf.MODEL_TENSOR


def arwkv7_config(
    key: Callable[[str], object], n_vocab: int, optional: Callable[[str], object | None]
) -> Arwkv7Config:
    """From ``arwkv7.*`` metadata (``key`` raises for a missing key)."""
    shift = optional("token_shift_count")
    if shift is not None and _int(shift, "token_shift_count") != 1:
        raise ModelFormatError(f"arwkv7 needs token_shift_count 1, got {shift!r}")
    eps = optional("attention.layer_norm_rms_epsilon")
    gate = optional("attention.gate_lora_rank")
    try:
        return Arwkv7Config(
            d_model=_int(key("embedding_length"), "embedding_length"),
            n_layer=_int(key("block_count"), "block_count"),
            n_vocab=n_vocab,
            d_ff=_int(key("feed_forward_length"), "feed_forward_length"),
            head_size=_int(key("wkv.head_size"), "wkv.head_size"),
            n_lora_decay=_int(key("attention.decay_lora_rank"), "attention.decay_lora_rank"),
            n_lora_iclr=_int(key("attention.iclr_lora_rank"), "attention.iclr_lora_rank"),
            n_lora_value_res_mix=_int(
                key("attention.value_residual_mix_lora_rank"), "attention.value_residual_mix_lora_rank"
            ),
            n_lora_gate=0 if gate is None else _int(gate, "attention.gate_lora_rank"),
            eps=1e-6 if eps is None else float(eps),  # type: ignore[arg-type]
        )
    except ValueError as exc:
        raise ModelFormatError(f"inconsistent hyperparameters ({exc})") from exc


def build_arwkv7(ckpt: Checkpoint, dtype: torch.dtype, compile: CompileSetting) -> Arwkv7Model:
    cfg = ckpt.config
    assert isinstance(cfg, Arwkv7Config)
    d, f = cfg.d_model, cfg.d_ff
    layers = []
    for b in range(cfg.n_layer):

        def get(kind: gguf.MODEL_TENSOR, shape: tuple[int, ...], suffix: str = ".weight") -> torch.Tensor:
            return ckpt.get(name(kind, b, suffix), shape)  # noqa: B023 (used at once, inside the loop)

        def has(kind: gguf.MODEL_TENSOR, suffix: str = ".weight") -> bool:
            return name(kind, b, suffix) in ckpt.tensors  # noqa: B023

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
        if has(T.TIME_MIX_G1) and has(T.TIME_MIX_G2):
            layer.g1 = get(T.TIME_MIX_G1, (cfg.n_lora_gate, d))
            layer.g2 = get(T.TIME_MIX_G2, (d, cfg.n_lora_gate))
        if has(T.TIME_MIX_LN) and has(T.TIME_MIX_LN, ".bias"):
            layer.ln_x, layer.ln_x_b = get(T.TIME_MIX_LN, (d,)), get(T.TIME_MIX_LN, (d,), ".bias")
        layers.append(layer)
    weights = Arwkv7Weights(
        embedding=ckpt.get(name(T.TOKEN_EMBD), (cfg.n_vocab, d)),
        layers=layers,
        norm_f=ckpt.get(name(T.OUTPUT_NORM), (d,)),
        lm_head=ckpt.get(name(T.OUTPUT), (cfg.n_vocab, d)),
    )
    return Arwkv7Model(cfg, weights, dtype=dtype, compile=compile)
