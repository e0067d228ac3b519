"""RWKV in llama.cpp's form: GGUF hyperparameters, weights by tensor name, and BlinkDL ``.pth`` state dicts
mapped into that form (as llama.cpp's converter maps them).

``config_from_gguf(arch, key, n_vocab, optional)`` reads ``{arch}.*`` metadata through ``key`` (which raises
ModelFormatError for a missing key); ``build_rwkv(ckpt)`` makes the model from a :class:`ModelTensors`'s
tensors; ``rwkv7_from_blink(state_dict)`` gives the config and llama.cpp-named tensors of a BlinkDL
RWKV-7 checkpoint (the ``rwkv`` package's ``.pth`` files).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.arwkv7 import arwkv7_config, build_arwkv7
from rsmem.loaders.rwkv.keys import ArchKeys, LayerTensors, consistent
from rsmem.loaders.rwkv.rwkv6 import (
    BLINK_NORMS,
    blink_outer,
    blink_reader,
    build_rwkv6,
    outer_tensors,
    rwkv6_config,
)
from rsmem.loaders.rwkv.rwkv6qwen2 import build_rwkv6qwen2, rwkv6qwen2_config
from rsmem.loaders.tensors import tensor_name as name
from rsmem.models.rwkv.arwkv7 import Arwkv7Model
from rsmem.models.rwkv.rwkv6 import Rwkv6Config, Rwkv6Model
from rsmem.models.rwkv.rwkv6qwen2 import Rwkv6Qwen2Model
from rsmem.models.rwkv.rwkv7 import Rwkv7Config, Rwkv7Layer, Rwkv7Model, Rwkv7Weights
from rsmem.models.step.compiled import CompileSetting

if TYPE_CHECKING:
    from rsmem.loaders.tensors import ModelTensors

RWKV_ARCHS = ("rwkv7", "rwkv6", "arwkv7", "rwkv6qwen2")
T = gguf.MODEL_TENSOR
LERPS_7 = ("r", "w", "k", "v", "a", "g")  # order of time_mix_lerp_fused

Key = Callable[[str], object]


def config_from_gguf(
    arch: str, key: Key, n_vocab: int, optional: Callable[[str], object | None]
) -> Rwkv7Config | Rwkv6Config:
    keys = ArchKeys(arch, key, optional)
    if arch == "rwkv6":
        return rwkv6_config(keys, n_vocab)
    if arch == "arwkv7":
        return arwkv7_config(keys, n_vocab)
    if arch == "rwkv6qwen2":
        return rwkv6qwen2_config(keys, n_vocab)
    if arch != "rwkv7":
        raise ModelFormatError(f"unsupported RWKV architecture {arch!r}")
    keys.token_shift(2)
    gate = keys.integer("attention.gate_lora_rank")
    eps = keys.float_or("attention.layer_norm_epsilon", 1e-5)
    with consistent():
        return Rwkv7Config(**keys.body(), **keys.v7_loras(), n_vocab=n_vocab, n_lora_gate=gate, eps=eps)


def build_rwkv(
    ckpt: ModelTensors, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
) -> Rwkv7Model | Rwkv6Model | Arwkv7Model | Rwkv6Qwen2Model:
    """The model of ``ckpt``; ``dtype``: its big matrices' (float32 or bfloat16); ``compile``: the compiled
    one-sequence decode step (see ``Rwkv7Model.set_compile``)."""
    if ckpt.arch == "rwkv7":
        return _rwkv7(ckpt, dtype, compile)
    if ckpt.arch == "rwkv6":
        return build_rwkv6(ckpt, dtype, compile)
    if ckpt.arch == "arwkv7":
        return build_arwkv7(ckpt, dtype, compile)
    if ckpt.arch == "rwkv6qwen2":
        return build_rwkv6qwen2(ckpt, dtype, compile)
    raise ModelFormatError(f"{ckpt.source}: unsupported architecture {ckpt.arch!r}")


def _rwkv7(ckpt: ModelTensors, dtype: torch.dtype, compile: CompileSetting) -> Rwkv7Model:
    cfg = ckpt.config
    assert isinstance(cfg, Rwkv7Config)
    d, f = cfg.d_model, cfg.d_ff
    layers = []
    for b in range(cfg.n_layer):
        t = LayerTensors(ckpt, b)
        get = t.get

        def lora(k1: gguf.MODEL_TENSOR, k2: gguf.MODEL_TENSOR, rank: int) -> tuple[torch.Tensor, ...]:
            return t.lora(k1, k2, d, rank)  # noqa: B023 (used at once, inside the loop)

        w1, w2 = lora(T.TIME_MIX_W1, T.TIME_MIX_W2, cfg.n_lora_decay)
        a1, a2 = lora(T.TIME_MIX_A1, T.TIME_MIX_A2, cfg.n_lora_iclr)
        g1, g2 = lora(T.TIME_MIX_G1, T.TIME_MIX_G2, cfg.n_lora_gate)
        layer = Rwkv7Layer(
            attn_norm=get(T.ATTN_NORM, (d,)),
            attn_norm_b=get(T.ATTN_NORM, (d,), ".bias"),
            ffn_norm=get(T.ATTN_NORM_2, (d,)),
            ffn_norm_b=get(T.ATTN_NORM_2, (d,), ".bias"),
            lerp=get(T.TIME_MIX_LERP_FUSED, (6, d)),
            w0=get(T.TIME_MIX_W0, (d,)),
            w1=w1,
            w2=w2,
            a0=get(T.TIME_MIX_A0, (d,)),
            a1=a1,
            a2=a2,
            g1=g1,
            g2=g2,
            k_k=get(T.TIME_MIX_K_K, (d,)),
            k_a=get(T.TIME_MIX_K_A, (d,)),
            r_k=get(T.TIME_MIX_R_K, (d,)),
            receptance=get(T.TIME_MIX_RECEPTANCE, (d, d)),
            key=get(T.TIME_MIX_KEY, (d, d)),
            value=get(T.TIME_MIX_VALUE, (d, d)),
            output=get(T.TIME_MIX_OUTPUT, (d, d)),
            ln_x=get(T.TIME_MIX_LN, (d,)),
            ln_x_b=get(T.TIME_MIX_LN, (d,), ".bias"),
            ffn_lerp_k=get(T.CHANNEL_MIX_LERP_K, (d,)),
            ffn_key=get(T.CHANNEL_MIX_KEY, (f, d)),
            ffn_value=get(T.CHANNEL_MIX_VALUE, (d, f)),
        )
        if b > 0:  # the first layer's v0/v1/v2 are llama.cpp's dummies (copies of a0/a1/a2)
            layer.v0 = get(T.TIME_MIX_V0, (d,))
            layer.v1, layer.v2 = lora(T.TIME_MIX_V1, T.TIME_MIX_V2, cfg.n_lora_value_res_mix)
        layers.append(layer)
    weights = Rwkv7Weights(layers=layers, **outer_tensors(ckpt, cfg.n_vocab, d))
    return Rwkv7Model(cfg, weights, dtype=dtype, compile=compile)


# ------------------------------------------------------------------ BlinkDL checkpoints


def rwkv7_from_blink(sd: Mapping[str, torch.Tensor]) -> tuple[Rwkv7Config, dict[str, torch.Tensor]]:
    """The config and llama.cpp-named float32 tensors of a BlinkDL RWKV-7 state dict (``emb.weight``,
    ``blocks.N.att.*``, ...), transformed as llama.cpp's converter does: lerps stacked ``[6, 1, 1, C]``,
    low-rank matrices as ``[out, in]``, ``r_k`` flattened, dummy ``v0/v1/v2`` in layer 0."""

    t = blink_reader(sd, "RWKV-7")
    n_layer, out = blink_outer(sd, t)
    n_vocab, d = t("emb.weight").shape
    n_head, head_size = t("blocks.0.att.r_k").shape
    plain = BLINK_NORMS | {
        "att.w0": (T.TIME_MIX_W0, ".weight"), "att.a0": (T.TIME_MIX_A0, ".weight"),
        "att.v0": (T.TIME_MIX_V0, ".weight"), "att.k_k": (T.TIME_MIX_K_K, ".weight"),
        "att.k_a": (T.TIME_MIX_K_A, ".weight"), "att.r_k": (T.TIME_MIX_R_K, ".weight"),
        "att.receptance.weight": (T.TIME_MIX_RECEPTANCE, ".weight"),
        "att.key.weight": (T.TIME_MIX_KEY, ".weight"), "att.value.weight": (T.TIME_MIX_VALUE, ".weight"),
        "att.output.weight": (T.TIME_MIX_OUTPUT, ".weight"),
        "att.ln_x.weight": (T.TIME_MIX_LN, ".weight"), "att.ln_x.bias": (T.TIME_MIX_LN, ".bias"),
        "ffn.x_k": (T.CHANNEL_MIX_LERP_K, ".weight"), "ffn.key.weight": (T.CHANNEL_MIX_KEY, ".weight"),
        "ffn.value.weight": (T.CHANNEL_MIX_VALUE, ".weight"),
    }  # fmt: skip
    loras = {"w1": T.TIME_MIX_W1, "w2": T.TIME_MIX_W2, "a1": T.TIME_MIX_A1, "a2": T.TIME_MIX_A2,
             "v1": T.TIME_MIX_V1, "v2": T.TIME_MIX_V2, "g1": T.TIME_MIX_G1, "g2": T.TIME_MIX_G2}  # fmt: skip
    for b in range(n_layer):
        p = f"blocks.{b}."
        for src, (kind, suffix) in plain.items():
            if b == 0 and src == "att.v0":
                continue
            tensor = t(p + src)
            out[name(kind, b, suffix)] = tensor.flatten() if tensor.dim() != 2 or src == "att.r_k" else tensor
        for src, kind in loras.items():
            if b == 0 and src.startswith("v"):
                continue
            out[name(kind, b)] = t(f"{p}att.{src}").t().contiguous()  # [in, out] -> [out, in]
        out[name(T.TIME_MIX_LERP_FUSED, b)] = torch.stack(
            [t(f"{p}att.x_{x}").flatten() for x in LERPS_7]
        ).view(6, 1, 1, d)
    for dummy, kind in (
        (T.TIME_MIX_V0, T.TIME_MIX_A0),
        (T.TIME_MIX_V1, T.TIME_MIX_A1),
        (T.TIME_MIX_V2, T.TIME_MIX_A2),
    ):
        out[name(dummy, 0)] = out[name(kind, 0)].clone()
    config = Rwkv7Config(
        d_model=d,
        n_layer=n_layer,
        n_vocab=n_vocab,
        head_size=head_size,
        d_ff=t("blocks.0.ffn.key.weight").shape[0],
        n_lora_decay=t("blocks.0.att.w1").shape[1],
        n_lora_iclr=t("blocks.0.att.a1").shape[1],
        n_lora_value_res_mix=t("blocks.1.att.v1").shape[1] if n_layer > 1 else 32,
        n_lora_gate=t("blocks.0.att.g1").shape[1],
    )
    if config.n_head != n_head:
        raise ModelFormatError(f"r_k has {n_head} heads, the embedding width {d} makes {config.n_head}")
    return config, out
