"""RWKV-6 in llama.cpp's form: GGUF hyperparameters, weights by tensor name, and BlinkDL ``.pth`` state dicts
mapped into that form as llama.cpp's converter maps its HF twin (lerps ``w, k, v, r, g`` stacked into
``time_mix_lerp_fused`` ``[5, 1, 1, C]``, ``time_mix_w1`` and the decay low-rank matrices as ``[out, in]``,
``time_mix_w2`` as ``[5, C, extra]``). ``rsmem.loaders.rwkv.build`` dispatches here."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.keys import ArchKeys, LayerTensors, consistent, rwkv6_time_mix
from rsmem.loaders.tensors import tensor_name as name
from rsmem.models.rwkv.rwkv6 import Rwkv6Config, Rwkv6Layer, Rwkv6Model, Rwkv6Weights
from rsmem.models.step.compiled import CompileSetting

if TYPE_CHECKING:
    from rsmem.loaders.tensors import ModelTensors

T = gguf.MODEL_TENSOR
LERPS_6 = ("w", "k", "v", "r", "g")  # order of time_mix_lerp_fused


def outer_tensors(ckpt: ModelTensors, n_vocab: int, d: int) -> dict[str, torch.Tensor]:
    """The tensors around the blocks, as both RWKV weights classes name them: the embedding and its
    layer norm, the output norm, and the head (the embedding when the file ties them)."""
    emb = ckpt.get(name(T.TOKEN_EMBD), (n_vocab, d))
    head = name(T.OUTPUT)
    return {
        "embedding": emb,
        "emb_norm": ckpt.get(name(T.TOKEN_EMBD_NORM), (d,)),
        "emb_norm_b": ckpt.get(name(T.TOKEN_EMBD_NORM, None, ".bias"), (d,)),
        "norm_f": ckpt.get(name(T.OUTPUT_NORM), (d,)),
        "norm_f_b": ckpt.get(name(T.OUTPUT_NORM, None, ".bias"), (d,)),
        "lm_head": ckpt.get(head, (n_vocab, d)) if head in ckpt.tensors else emb,
    }


def rwkv6_config(keys: ArchKeys, n_vocab: int) -> Rwkv6Config:
    """From ``rwkv6.*`` metadata."""
    keys.token_shift(2)
    rescale = keys.integer_or("rescale_every_n_layers", 0)
    eps = keys.float_or("attention.layer_norm_epsilon", 1e-5)
    with consistent():
        return Rwkv6Config(
            **keys.body(), **keys.v6_extra(), n_vocab=n_vocab, rescale_every_n_layers=rescale, eps=eps
        )


def build_rwkv6(
    ckpt: ModelTensors, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
) -> Rwkv6Model:
    cfg = ckpt.config
    assert isinstance(cfg, Rwkv6Config)
    d, f, e, de = cfg.d_model, cfg.d_ff, cfg.time_mix_extra_dim, cfg.time_decay_extra_dim
    layers = []
    for b in range(cfg.n_layer):
        t = LayerTensors(ckpt, b)
        get = t.get
        if not t.has(T.TIME_MIX_LERP_FUSED):
            raise ModelFormatError(
                f"{ckpt.source}: rwkv6 without time_mix_lerp_fused (layer {b}) is not supported"
            )
        layers.append(
            Rwkv6Layer(
                attn_norm=get(T.ATTN_NORM, (d,)),
                attn_norm_b=get(T.ATTN_NORM, (d,), ".bias"),
                ffn_norm=get(T.ATTN_NORM_2, (d,)),
                ffn_norm_b=get(T.ATTN_NORM_2, (d,), ".bias"),
                **rwkv6_time_mix(t, d, e, de),
                first=get(T.TIME_MIX_FIRST, (cfg.n_head, cfg.head_size)),
                key=get(T.TIME_MIX_KEY, (d, d)),
                value=get(T.TIME_MIX_VALUE, (d, d)),
                ln_x=get(T.TIME_MIX_LN, (d,)),
                ln_x_b=get(T.TIME_MIX_LN, (d,), ".bias"),
                ffn_lerp_k=get(T.CHANNEL_MIX_LERP_K, (d,)),
                ffn_lerp_r=get(T.CHANNEL_MIX_LERP_R, (d,)),
                ffn_key=get(T.CHANNEL_MIX_KEY, (f, d)),
                ffn_value=get(T.CHANNEL_MIX_VALUE, (d, f)),
                ffn_receptance=get(T.CHANNEL_MIX_RECEPTANCE, (d, d)),
            )
        )
    weights = Rwkv6Weights(layers=layers, **outer_tensors(ckpt, cfg.n_vocab, d))
    return Rwkv6Model(cfg, weights, dtype=dtype, compile=compile)


BLINK_NORMS = {
    "ln1.weight": (T.ATTN_NORM, ".weight"), "ln1.bias": (T.ATTN_NORM, ".bias"),
    "ln2.weight": (T.ATTN_NORM_2, ".weight"), "ln2.bias": (T.ATTN_NORM_2, ".bias"),
}  # fmt: skip


def blink_reader(sd: Mapping[str, torch.Tensor], what: str) -> Callable[[str], torch.Tensor]:
    """``t(key)``: the state dict's tensor as float32; ModelFormatError naming it when missing."""

    def t(key: str) -> torch.Tensor:
        if key not in sd:
            raise ModelFormatError(f"missing tensor {key!r} in the {what} checkpoint")
        return sd[key].to(torch.float32)

    return t


def blink_outer(
    sd: Mapping[str, torch.Tensor], t: Callable[[str], torch.Tensor]
) -> tuple[int, dict[str, torch.Tensor]]:
    """A BlinkDL state dict's layer count and its tensors around the blocks under llama.cpp's names."""
    n_layer = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("blocks."))
    return n_layer, {
        name(T.TOKEN_EMBD): t("emb.weight"),
        name(T.TOKEN_EMBD_NORM): t("blocks.0.ln0.weight"),
        name(T.TOKEN_EMBD_NORM, None, ".bias"): t("blocks.0.ln0.bias"),
        name(T.OUTPUT_NORM): t("ln_out.weight"),
        name(T.OUTPUT_NORM, None, ".bias"): t("ln_out.bias"),
        name(T.OUTPUT): t("head.weight"),
    }


def rwkv6_from_blink(sd: Mapping[str, torch.Tensor]) -> tuple[Rwkv6Config, dict[str, torch.Tensor]]:
    """The config and llama.cpp-named float32 tensors of a BlinkDL RWKV-6 state dict (no rescaling)."""

    t = blink_reader(sd, "RWKV-6")
    n_layer, out = blink_outer(sd, t)
    n_vocab, d = t("emb.weight").shape
    n_head, head_size = t("blocks.0.att.time_faaaa").shape[:2]
    plain = BLINK_NORMS | {
        "att.time_maa_x": (T.TIME_MIX_LERP_X, ".weight"), "att.time_decay": (T.TIME_MIX_DECAY, ".weight"),
        "att.receptance.weight": (T.TIME_MIX_RECEPTANCE, ".weight"),
        "att.key.weight": (T.TIME_MIX_KEY, ".weight"), "att.value.weight": (T.TIME_MIX_VALUE, ".weight"),
        "att.gate.weight": (T.TIME_MIX_GATE, ".weight"), "att.output.weight": (T.TIME_MIX_OUTPUT, ".weight"),
        "att.ln_x.weight": (T.TIME_MIX_LN, ".weight"), "att.ln_x.bias": (T.TIME_MIX_LN, ".bias"),
        "ffn.time_maa_k": (T.CHANNEL_MIX_LERP_K, ".weight"),
        "ffn.time_maa_r": (T.CHANNEL_MIX_LERP_R, ".weight"),
        "ffn.key.weight": (T.CHANNEL_MIX_KEY, ".weight"),
        "ffn.value.weight": (T.CHANNEL_MIX_VALUE, ".weight"),
        "ffn.receptance.weight": (T.CHANNEL_MIX_RECEPTANCE, ".weight"),
    }  # fmt: skip
    for b in range(n_layer):
        p = f"blocks.{b}."
        for src, (kind, suffix) in plain.items():
            tensor = t(p + src)
            out[name(kind, b, suffix)] = tensor if tensor.dim() == 2 else tensor.flatten()
        out[name(T.TIME_MIX_FIRST, b)] = t(p + "att.time_faaaa").reshape(n_head, head_size)
        out[name(T.TIME_MIX_W1, b)] = t(p + "att.time_maa_w1").t().contiguous()  # [5 * extra, C]
        out[name(T.TIME_MIX_W2, b)] = t(p + "att.time_maa_w2").permute(0, 2, 1).contiguous()  # [5, C, extra]
        out[name(T.TIME_MIX_DECAY_W1, b)] = t(p + "att.time_decay_w1").t().contiguous()
        out[name(T.TIME_MIX_DECAY_W2, b)] = t(p + "att.time_decay_w2").t().contiguous()
        lerps = [t(f"{p}att.time_maa_{x}").flatten() for x in LERPS_6]
        out[name(T.TIME_MIX_LERP_FUSED, b)] = torch.stack(lerps).view(5, 1, 1, d)
    config = Rwkv6Config(
        d_model=d,
        n_layer=n_layer,
        n_vocab=n_vocab,
        head_size=head_size,
        d_ff=t("blocks.0.ffn.key.weight").shape[0],
        time_mix_extra_dim=t("blocks.0.att.time_maa_w1").shape[1] // 5,
        time_decay_extra_dim=t("blocks.0.att.time_decay_w1").shape[1],
    )
    if config.n_head != n_head:
        raise ModelFormatError(
            f"time_faaaa has {n_head} heads, the embedding width {d} makes {config.n_head}"
        )
    return config, out
