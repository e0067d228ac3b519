"""Hybrid architectures in llama.cpp's form: their GGUF hyperparameters and their weights by tensor name.

``config_from_gguf(arch, key)`` reads ``{arch}.*`` metadata through ``key`` (which raises ModelFormatError
for a missing key); ``build_hybrid(ckpt)`` makes the model from a :class:`ModelTensors`'s tensors.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.hparams import Hparams, consistent
from rsmem.loaders.hybrid.qwen35 import build_qwen35, qwen35_config_from_gguf
from rsmem.loaders.tensors import ModelTensors, tensor_name
from rsmem.models.hybrid.lfm2 import Attention, Lfm2Config, Lfm2Layer, Lfm2Model, Lfm2Weights
from rsmem.models.hybrid.nemotron_h import (
    ATTENTION,
    MAMBA,
    MLP,
    Mamba2Mixer,
    NemotronHConfig,
    NemotronHLayer,
    NemotronHModel,
    NemotronHWeights,
)
from rsmem.models.hybrid.qwen35 import Qwen35Config, Qwen35Model
from rsmem.models.step.compiled import CompileSetting

HYBRID_ARCHS = ("lfm2", "nemotron_h", "qwen35")
T = gguf.MODEL_TENSOR

Key = Callable[[str], object]  # "{arch}.<key>" metadata value; raises ModelFormatError when missing


def config_from_gguf(
    arch: str, key: Key, n_vocab: int, optional: Callable[[str], object | None]
) -> Lfm2Config | NemotronHConfig | Qwen35Config:
    """The architecture's hyperparameters, each in its range (``hparams.py``); ModelFormatError names the
    key."""
    if arch == "qwen35":
        return qwen35_config_from_gguf(key, n_vocab, optional)
    keys = Hparams(arch, key, optional)
    if arch == "nemotron_h":
        return _nemotron_h_config(keys, n_vocab)
    if arch == "lfm2":
        return _lfm2_config(keys, n_vocab)
    raise ModelFormatError(f"unsupported hybrid architecture {arch!r}")


def _lfm2_config(keys: Hparams, n_vocab: int) -> Lfm2Config:
    if keys.optional("attention.sliding_window"):
        raise ModelFormatError("LFM2 with a sliding window (attention.sliding_window) is not supported")
    n_layer = keys.count("block_count")
    d_model = keys.count("embedding_length")
    n_head = keys.count("attention.head_count")
    keys.divides("attention.head_count", n_head, "embedding_length", d_model)
    n_head_kv = _kv_heads(keys, n_layer, n_head)
    with consistent():
        return Lfm2Config(
            d_model=d_model,
            n_layer=n_layer,
            n_vocab=n_vocab,
            d_ff=keys.count("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            l_cache=keys.count("shortconv.l_cache", 2),
            rope_base=keys.number_or("rope.freq_base", 10000.0, 0.0, above=True),
            eps=keys.epsilon("attention.layer_norm_rms_epsilon"),
            n_ctx_train=keys.count_or("context_length", 128_000),
        )


def _kv_heads(keys: Hparams, n_layer: int, n_head: int) -> tuple[int, ...]:
    """Per-layer key/value head counts: 0 (no attention in the layer) or a divisor of the head count."""
    n_head_kv = keys.counts("attention.head_count_kv", n_layer)
    for b, n_kv in enumerate(n_head_kv):
        if n_kv:
            keys.divides("attention.head_count_kv", n_kv, "attention.head_count", n_head, f" in layer {b}")
    return n_head_kv


def _nemotron_h_config(keys: Hparams, n_vocab: int) -> NemotronHConfig:
    """llama.cpp's rule: a layer is Mamba-2 when it has neither KV heads nor an FFN, attention when it has
    KV heads, an MLP otherwise."""
    if keys.optional("expert_count"):
        raise ModelFormatError("Nemotron-H with experts (MoE) is not supported")
    n_layer = keys.count("block_count")
    n_kv_raw = keys.counts("attention.head_count_kv", n_layer)
    d_ff = keys.counts("feed_forward_length", n_layer)
    attention = any(n_kv_raw)
    d_model = keys.count("embedding_length")
    n_head = keys.count("attention.head_count", 1 if attention else 0)
    n_head_kv = _kv_heads(keys, n_layer, n_head) if attention else n_kv_raw
    head_dim = keys.count_or("attention.key_length", d_model // n_head if n_head else 0, 1)
    if attention and keys.count_or("attention.value_length", head_dim) != head_dim:
        raise keys.error("attention.value_length", f"differs from attention.key_length ({head_dim})")
    kinds = "".join(ATTENTION if kv else MLP if ff else MAMBA for kv, ff in zip(n_head_kv, d_ff, strict=True))
    d_inner, n_ssm_head = keys.count("ssm.inner_size"), keys.count("ssm.time_step_rank")
    n_group = keys.count("ssm.group_count")
    keys.divides("ssm.time_step_rank", n_ssm_head, "ssm.inner_size", d_inner)
    keys.divides("ssm.group_count", n_group, "ssm.time_step_rank", n_ssm_head)
    rms = keys.optional("attention.layer_norm_rms_epsilon")
    eps = keys.epsilon(
        "attention.layer_norm_rms_epsilon" if rms is not None else "attention.layer_norm_epsilon"
    )
    with consistent():
        return NemotronHConfig(
            d_model=d_model,
            n_vocab=n_vocab,
            kinds=kinds,
            d_inner=d_inner,
            d_state=keys.count("ssm.state_size"),
            d_conv=keys.count("ssm.conv_kernel"),
            n_ssm_head=n_ssm_head,
            n_group=n_group,
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            d_ff=d_ff,
            eps=eps,
        )


def build_hybrid(
    ckpt: ModelTensors, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
) -> Lfm2Model | NemotronHModel | Qwen35Model:
    """The model of ``ckpt`` (``dtype``: its matrices'; ``compile``: see the models' ``set_compile``)."""
    if ckpt.arch == "qwen35":
        return build_qwen35(ckpt, dtype, compile)
    if ckpt.arch == "lfm2":
        return _lfm2(ckpt, dtype, compile)
    if ckpt.arch == "nemotron_h":
        return _nemotron_h(ckpt, dtype, compile)
    raise ModelFormatError(f"{ckpt.source}: unsupported architecture {ckpt.arch!r}")


def _lfm2(ckpt: ModelTensors, dtype: torch.dtype, compile: CompileSetting) -> Lfm2Model:
    cfg = ckpt.config
    assert isinstance(cfg, Lfm2Config)
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    layers = []
    for b in range(cfg.n_layer):
        layer = Lfm2Layer(
            attn_norm=ckpt.get(tensor_name(T.ATTN_NORM, b), (d,)),
            ffn_norm=ckpt.get(tensor_name(T.FFN_NORM, b), (d,)),
            ffn_gate=ckpt.get(tensor_name(T.FFN_GATE, b), (f, d)),
            ffn_up=ckpt.get(tensor_name(T.FFN_UP, b), (f, d)),
            ffn_down=ckpt.get(tensor_name(T.FFN_DOWN, b), (d, f)),
        )
        n_kv = cfg.n_head_kv[b]
        if n_kv:
            layer.attention = Attention(
                wq=ckpt.get(tensor_name(T.ATTN_Q, b), (cfg.n_head * hd, d)),
                wk=ckpt.get(tensor_name(T.ATTN_K, b), (n_kv * hd, d)),
                wv=ckpt.get(tensor_name(T.ATTN_V, b), (n_kv * hd, d)),
                wo=ckpt.get(tensor_name(T.ATTN_OUT, b), (d, cfg.n_head * hd)),
                n_head=cfg.n_head,
                n_head_kv=n_kv,
                head_dim=hd,
                q_norm=ckpt.get(tensor_name(T.ATTN_Q_NORM, b), (hd,)),
                k_norm=ckpt.get(tensor_name(T.ATTN_K_NORM, b), (hd,)),
                rope_base=cfg.rope_base,
                n_rot=hd,
            )
        else:
            layer.conv = ckpt.get(tensor_name(T.SHORTCONV_CONV, b), (d, cfg.l_cache))
            layer.conv_in = ckpt.get(tensor_name(T.SHORTCONV_INPROJ, b), (3 * d, d))
            layer.conv_out = ckpt.get(tensor_name(T.SHORTCONV_OUTPROJ, b), (d, d))
        layers.append(layer)
    emb = ckpt.get(tensor_name(T.TOKEN_EMBD), (cfg.n_vocab, d))
    head = tensor_name(T.OUTPUT)
    weights = Lfm2Weights(
        embedding=emb,
        layers=layers,
        norm_f=ckpt.get(tensor_name(T.TOKEN_EMBD_NORM), (d,)),  # LFM2's output norm has this name in GGUF
        lm_head=ckpt.get(head, (cfg.n_vocab, d)) if head in ckpt.tensors else emb,
    )
    return Lfm2Model(cfg, weights, dtype=dtype, compile=compile)


def _nemotron_h(ckpt: ModelTensors, dtype: torch.dtype, compile: CompileSetting) -> NemotronHModel:
    cfg = ckpt.config
    assert isinstance(cfg, NemotronHConfig)
    d, di, nh, hd = cfg.d_model, cfg.d_inner, cfg.n_ssm_head, cfg.head_dim
    layers = []
    for b, kind in enumerate(cfg.kinds):
        layer = NemotronHLayer(norm=ckpt.get(tensor_name(T.ATTN_NORM, b), (d,)))
        if kind == MAMBA:
            bias = tensor_name(T.SSM_CONV1D, b, ".bias")
            layer.mixer = Mamba2Mixer(
                in_proj=ckpt.get(tensor_name(T.SSM_IN, b), (di + cfg.conv_dim + nh, d)),
                conv_weight=ckpt.get(tensor_name(T.SSM_CONV1D, b), (cfg.conv_dim, cfg.d_conv)),
                conv_bias=ckpt.get(bias, (cfg.conv_dim,)) if bias in ckpt.tensors else None,
                dt_bias=ckpt.get(tensor_name(T.SSM_DT, b, ".bias"), (nh,)),
                A=ckpt.get(tensor_name(T.SSM_A, b, ""), (nh,)),
                D=ckpt.get(tensor_name(T.SSM_D, b, ""), (nh,)),
                ssm_norm=ckpt.get(tensor_name(T.SSM_NORM, b), (di,)),
                out_proj=ckpt.get(tensor_name(T.SSM_OUT, b), (d, di)),
            )
        elif kind == ATTENTION:
            n_kv = cfg.n_head_kv[b]
            for extra in (tensor_name(T.ATTN_Q, b, ".bias"), tensor_name(T.ATTN_OUT, b, ".bias")):
                if extra in ckpt.tensors:
                    raise ModelFormatError(f"{ckpt.source}: attention biases ({extra}) are not supported")
            layer.attention = Attention(
                wq=ckpt.get(tensor_name(T.ATTN_Q, b), (cfg.n_head * hd, d)),
                wk=ckpt.get(tensor_name(T.ATTN_K, b), (n_kv * hd, d)),
                wv=ckpt.get(tensor_name(T.ATTN_V, b), (n_kv * hd, d)),
                wo=ckpt.get(tensor_name(T.ATTN_OUT, b), (d, cfg.n_head * hd)),
                n_head=cfg.n_head,
                n_head_kv=n_kv,
                head_dim=hd,
            )
        else:
            layer.ffn_up = ckpt.get(tensor_name(T.FFN_UP, b), (cfg.d_ff[b], d))
            layer.ffn_down = ckpt.get(tensor_name(T.FFN_DOWN, b), (d, cfg.d_ff[b]))
        layers.append(layer)
    emb = ckpt.get(tensor_name(T.TOKEN_EMBD), (cfg.n_vocab, d))
    head = tensor_name(T.OUTPUT)
    weights = NemotronHWeights(
        embedding=emb,
        layers=layers,
        norm_f=ckpt.get(tensor_name(T.OUTPUT_NORM), (d,)),
        lm_head=ckpt.get(head, (cfg.n_vocab, d)) if head in ckpt.tensors else emb,
    )
    return NemotronHModel(cfg, weights, dtype=dtype, compile=compile)
