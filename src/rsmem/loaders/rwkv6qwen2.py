"""QRWKV-6 GGUF files (llama.cpp's ``rwkv6qwen2``): hyperparameters from ``rwkv6qwen2.*`` keys and the
weights by llama.cpp's tensor names (as its ``llama_model_rwkv6qwen2::load_arch_tensors`` creates them).

``rwkv6qwen2_config(key, n_vocab, optional)`` and ``build_rwkv6qwen2(ckpt, dtype, compile)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.checkpoint import metadata_int as _int
from rsmem.loaders.checkpoint import tensor_name as name
from rsmem.models.compiled import CompileSetting
from rsmem.models.rwkv6qwen2 import Rwkv6Qwen2Config, Rwkv6Qwen2Layer, Rwkv6Qwen2Model
from rsmem.models.rwkv_base import RmsBodyWeights

if TYPE_CHECKING:
    from rsmem.loaders.checkpoint import Checkpoint

T = gguf.MODEL_TENSOR


def rwkv6qwen2_config(
    key: Callable[[str], object], n_vocab: int, optional: Callable[[str], object | None]
) -> Rwkv6Qwen2Config:
    """From ``rwkv6qwen2.*`` metadata (``key`` raises for a missing key)."""
    shift = optional("token_shift_count")
    if shift is not None and _int(shift, "token_shift_count") != 1:
        raise ModelFormatError(f"rwkv6qwen2 needs token_shift_count 1, got {shift!r}")
    eps = optional("attention.layer_norm_rms_epsilon")
    kv = optional("attention.head_count_kv")
    if isinstance(kv, list):  # per layer: all alike here
        if len(set(kv)) != 1:
            raise ModelFormatError(f"rwkv6qwen2 with per-layer key/value head counts {kv} is not supported")
        kv = kv[0]
    try:
        return Rwkv6Qwen2Config(
            d_model=_int(key("embedding_length"), "embedding_length"),
            n_layer=_int(key("block_count"), "block_count"),
            n_vocab=n_vocab,
            head_size=_int(key("wkv.head_size"), "wkv.head_size"),
            d_ff=_int(key("feed_forward_length"), "feed_forward_length"),
            time_mix_extra_dim=_int(key("time_mix_extra_dim"), "time_mix_extra_dim"),
            time_decay_extra_dim=_int(key("time_decay_extra_dim"), "time_decay_extra_dim"),
            eps=1e-6 if eps is None else float(eps),  # type: ignore[arg-type]
            n_head_kv=0 if kv is None else _int(kv, "attention.head_count_kv"),
        )
    except ValueError as exc:
        raise ModelFormatError(f"inconsistent hyperparameters ({exc})") from exc


def build_rwkv6qwen2(ckpt: Checkpoint, dtype: torch.dtype, compile: CompileSetting) -> Rwkv6Qwen2Model:
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

        def get(kind: gguf.MODEL_TENSOR, shape: tuple[int, ...], suffix: str = ".weight") -> torch.Tensor:
            return ckpt.get(name(kind, b, suffix), shape)  # noqa: B023 (used at once, inside the loop)

        def bias(kind: gguf.MODEL_TENSOR, n: int) -> torch.Tensor | None:
            return get(kind, (n,), ".bias") if name(kind, b, ".bias") in ckpt.tensors else None  # noqa: B023

        if name(T.TIME_MIX_FIRST, b) in ckpt.tensors:
            raise ModelFormatError(
                f"{ckpt.source}: rwkv6qwen2 with time_mix_first (RWKV-6's bonus, layer {b}) is not supported"
            )
        layers.append(
            Rwkv6Qwen2Layer(
                attn_norm=get(T.ATTN_NORM, (d,)),
                lerp_x=get(T.TIME_MIX_LERP_X, (d,)),
                lerp=get(T.TIME_MIX_LERP_FUSED, (5, d)),
                w1=get(T.TIME_MIX_W1, (5 * e, d)),
                w2=get(T.TIME_MIX_W2, (5, d, e)),
                decay=get(T.TIME_MIX_DECAY, (d,)),
                decay_w1=get(T.TIME_MIX_DECAY_W1, (de, d)),
                decay_w2=get(T.TIME_MIX_DECAY_W2, (d, de)),
                receptance=get(T.TIME_MIX_RECEPTANCE, (d, d)),
                key=get(T.TIME_MIX_KEY, (dkv, d)),
                value=get(T.TIME_MIX_VALUE, (dkv, d)),
                gate=get(T.TIME_MIX_GATE, (d, d)),
                output=get(T.TIME_MIX_OUTPUT, (d, d)),
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
