"""Qwen3.5 (``qwen35``) in llama.cpp's form: its GGUF hyperparameters, its model from a checkpoint's tensors,
and an HF folder (``Qwen3_5ForCausalLM``, ``model_type`` ``qwen3_5_text``) mapped into that form with the
transforms of llama.cpp's converter (``conversion/qwen.py``: norm weights ``1 + w`` except the delta net's
output norm, ``ssm_a = -exp(A_log)``, squeezed conv kernels, value heads reordered from grouped to tiled).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.hparams import Hparams, consistent
from rsmem.loaders.tensors import ModelTensors, tensor_name
from rsmem.loaders.tokenizer import tokenizer_data_from_hf
from rsmem.models.hybrid.qwen35 import (
    DeltaNet,
    GatedAttention,
    Qwen35Config,
    Qwen35Layer,
    Qwen35Model,
    Qwen35Weights,
)
from rsmem.models.step.compiled import CompileSetting

__all__ = [
    "HF_MODEL_TYPES",
    "build_qwen35",
    "qwen35_checkpoint",
    "qwen35_config_from_gguf",
    "write_qwen35_hparams",
]

T = gguf.MODEL_TENSOR
HF_MODEL_TYPES = ("qwen3_5_text", "qwen3_5")
Key = Callable[[str], object]


def qwen35_config_from_gguf(key: Key, n_vocab: int, optional: Callable[[str], object | None]) -> Qwen35Config:
    """``qwen35.*`` metadata as llama.cpp's ``llama_model_qwen35::load_arch_hparams`` reads it (the layer
    kinds from ``attention.recurrent_layers``, else every ``full_attention_interval``-th is attention). MTP
    layers (``nextn_predict_layers``, the last blocks) are left out: the model is the trunk. Each value is
    checked in its range (``hparams.py``); ModelFormatError names the key."""
    keys = Hparams("qwen35", key, optional)
    if keys.optional("expert_count"):
        raise ModelFormatError("Qwen3.5 with experts (qwen35moe) is not supported")
    n_layer_all = keys.count("block_count")
    n_mtp = keys.count_or("nextn_predict_layers", 0, 0)
    if n_mtp >= n_layer_all:
        raise keys.error("nextn_predict_layers", f"is {n_mtp}, leaving no layer of the {n_layer_all} blocks")
    n_layer = n_layer_all - n_mtp  # MTP: unused
    flags = keys.optional("attention.recurrent_layers")
    if flags is None:
        interval = keys.count_or("full_attention_interval", 4)
        recurrent = tuple((il + 1) % interval != 0 for il in range(n_layer))
    elif not isinstance(flags, list) or len(flags) != n_layer_all:
        raise keys.error("attention.recurrent_layers", f"is {flags!r}, not {n_layer_all} flags")
    else:
        recurrent = tuple(bool(v) for v in flags)[:n_layer]
    head_dim = keys.count("attention.key_length")
    if keys.count_or("attention.value_length", head_dim) != head_dim:
        raise keys.error("attention.value_length", f"differs from attention.key_length ({head_dim})")
    n_head, n_head_kv = keys.count("attention.head_count"), keys.count("attention.head_count_kv")
    keys.divides("attention.head_count_kv", n_head_kv, "attention.head_count", n_head)
    n_k, n_v = keys.count("ssm.group_count"), keys.count("ssm.time_step_rank")
    keys.divides("ssm.group_count", n_k, "ssm.time_step_rank", n_v)
    d_state, d_inner = keys.count("ssm.state_size"), keys.count("ssm.inner_size")
    if d_inner != n_v * d_state:
        raise keys.error(
            "ssm.inner_size",
            f"is {d_inner}, not ssm.time_step_rank x ssm.state_size ({n_v} x {d_state} = {n_v * d_state})",
        )
    n_rot = keys.count_or("rope.dimension_count", head_dim)
    if n_rot % 2 or n_rot > head_dim:
        raise keys.error("rope.dimension_count", f"is {n_rot}, not even and at most key_length ({head_dim})")
    sections = keys.optional("rope.dimension_sections")
    with consistent():
        return Qwen35Config(
            d_model=keys.count("embedding_length"),
            n_layer=n_layer,
            n_vocab=n_vocab,
            d_ff=keys.count("feed_forward_length"),
            n_head=n_head,
            n_head_kv=n_head_kv,
            head_dim=head_dim,
            recurrent=recurrent,
            d_conv=keys.count("ssm.conv_kernel", 2),
            d_state=d_state,
            n_k_heads=n_k,
            n_v_heads=n_v,
            d_inner=d_inner,
            n_rot=n_rot,
            rope_base=keys.number_or("rope.freq_base", 10_000.0, 0.0, above=True),
            rope_sections=tuple(int(v) for v in sections) if isinstance(sections, list) else (),
            eps=keys.epsilon("attention.layer_norm_rms_epsilon"),
            n_ctx_train=keys.count_or("context_length", 262_144),
        )


def build_qwen35(
    ckpt: ModelTensors, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
) -> Qwen35Model:
    """The model of a ``qwen35`` checkpoint (llama.cpp's tensor names)."""
    cfg = ckpt.config
    assert isinstance(cfg, Qwen35Config)
    d, f, hd = cfg.d_model, cfg.d_ff, cfg.head_dim
    nv = cfg.n_v_heads
    layers = []
    for b in range(cfg.n_layer):
        layer = Qwen35Layer(
            attn_norm=ckpt.get(tensor_name(T.ATTN_NORM, b), (d,)),
            post_norm=ckpt.get(tensor_name(T.ATTN_POST_NORM, b), (d,)),
            ffn_gate=ckpt.get(tensor_name(T.FFN_GATE, b), (f, d)),
            ffn_up=ckpt.get(tensor_name(T.FFN_UP, b), (f, d)),
            ffn_down=ckpt.get(tensor_name(T.FFN_DOWN, b), (d, f)),
        )
        if cfg.recurrent[b]:
            layer.delta = DeltaNet(
                qkv=ckpt.get(tensor_name(T.ATTN_QKV, b), (cfg.conv_dim, d)),
                gate=ckpt.get(tensor_name(T.ATTN_GATE, b), (cfg.d_inner, d)),
                beta=ckpt.get(tensor_name(T.SSM_BETA, b), (nv, d)),
                alpha=ckpt.get(tensor_name(T.SSM_ALPHA, b), (nv, d)),
                conv=ckpt.get(tensor_name(T.SSM_CONV1D, b), (cfg.conv_dim, cfg.d_conv)),
                dt_bias=ckpt.get(tensor_name(T.SSM_DT, b, ".bias"), (nv,)),
                a=ckpt.get(tensor_name(T.SSM_A, b, ""), (nv,)),
                norm=ckpt.get(tensor_name(T.SSM_NORM, b), (cfg.dv,)),
                out=ckpt.get(tensor_name(T.SSM_OUT, b), (d, cfg.d_inner)),
            )
        else:
            nkv = cfg.n_head_kv
            layer.attention = GatedAttention(
                wq=ckpt.get(tensor_name(T.ATTN_Q, b), (2 * cfg.n_head * hd, d)),
                wk=ckpt.get(tensor_name(T.ATTN_K, b), (nkv * hd, d)),
                wv=ckpt.get(tensor_name(T.ATTN_V, b), (nkv * hd, d)),
                wo=ckpt.get(tensor_name(T.ATTN_OUT, b), (d, cfg.n_head * hd)),
                q_norm=ckpt.get(tensor_name(T.ATTN_Q_NORM, b), (hd,)),
                k_norm=ckpt.get(tensor_name(T.ATTN_K_NORM, b), (hd,)),
            )
        layers.append(layer)
    emb = ckpt.get(tensor_name(T.TOKEN_EMBD), (cfg.n_vocab, d))
    head = tensor_name(T.OUTPUT)
    weights = Qwen35Weights(
        embedding=emb,
        layers=layers,
        norm_f=ckpt.get(tensor_name(T.OUTPUT_NORM), (d,)),
        lm_head=ckpt.get(head, (cfg.n_vocab, d)) if head in ckpt.tensors else emb,
    )
    return Qwen35Model(cfg, weights, dtype=dtype, compile=compile)


def write_qwen35_hparams(
    w: gguf.GGUFWriter, cfg: Qwen35Config, file_type: gguf.LlamaFileType, hf_config: dict
) -> None:
    """The ``qwen35.*`` keys llama.cpp's converter writes (``rsmem convert``), in its order."""
    text = hf_config.get("text_config") or hf_config
    w.add_block_count(cfg.n_layer)
    w.add_context_length(int(text.get("max_position_embeddings", cfg.n_ctx_train)))
    w.add_embedding_length(cfg.d_model)
    w.add_feed_forward_length(cfg.d_ff)
    w.add_head_count(cfg.n_head)
    w.add_head_count_kv(cfg.n_head_kv)
    w.add_rope_dimension_sections(list(cfg.rope_sections))
    w.add_rope_freq_base(cfg.rope_base)
    w.add_layer_norm_rms_eps(cfg.eps)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_file_type(file_type)
    w.add_ssm_conv_kernel(cfg.d_conv)
    w.add_ssm_state_size(cfg.d_state)
    w.add_ssm_group_count(cfg.n_k_heads)
    w.add_ssm_time_step_rank(cfg.n_v_heads)
    w.add_ssm_inner_size(cfg.d_inner)
    w.add_array("qwen35.attention.recurrent_layers", list(cfg.recurrent))  # no writer method in this gguf
    w.add_full_attention_interval(int(text.get("full_attention_interval", 4)))
    w.add_rope_dimension_count(cfg.n_rot)


# ------------------------------------------------------------------ HF folders

LINEAR = {  # linear_attn.<name> -> (tensor, suffix)
    "in_proj_qkv.weight": (T.ATTN_QKV, ".weight"),
    "in_proj_z.weight": (T.ATTN_GATE, ".weight"),
    "in_proj_b.weight": (T.SSM_BETA, ".weight"),
    "in_proj_a.weight": (T.SSM_ALPHA, ".weight"),
    "conv1d.weight": (T.SSM_CONV1D, ".weight"),
    "dt_bias": (T.SSM_DT, ".bias"),
    "A_log": (T.SSM_A, ""),
    "norm.weight": (T.SSM_NORM, ".weight"),
    "out_proj.weight": (T.SSM_OUT, ".weight"),
}
OTHER = {
    "input_layernorm.weight": T.ATTN_NORM,
    "post_attention_layernorm.weight": T.ATTN_POST_NORM,
    "mlp.gate_proj.weight": T.FFN_GATE,
    "mlp.up_proj.weight": T.FFN_UP,
    "mlp.down_proj.weight": T.FFN_DOWN,
    "self_attn.q_proj.weight": T.ATTN_Q,
    "self_attn.k_proj.weight": T.ATTN_K,
    "self_attn.v_proj.weight": T.ATTN_V,
    "self_attn.o_proj.weight": T.ATTN_OUT,
    "self_attn.q_norm.weight": T.ATTN_Q_NORM,
    "self_attn.k_norm.weight": T.ATTN_K_NORM,
}
PREFIXES = ("model.language_model.", "model.")


def tiled(t: torch.Tensor, dim: int, n_k_heads: int, head_dim: int) -> torch.Tensor:
    """Value heads along ``dim`` from transformers' grouped order (by key head) to llama.cpp's tiled one:
    llama.cpp's head ``v * n_k_heads + k`` is transformers' head ``k * (n_v_heads / n_k_heads) + v``."""
    shape = list(t.shape)
    per_k = shape[dim] // (n_k_heads * head_dim)
    t = t.reshape(*shape[:dim], n_k_heads, per_k, head_dim, *shape[dim + 1 :])
    return t.transpose(dim, dim + 1).reshape(shape)


def _config(config: dict, raw: dict[str, torch.Tensor], emb: str) -> Qwen35Config:
    text = config.get("text_config") or config
    n_layer = int(text["num_hidden_layers"])
    types = text.get("layer_types") or [
        "full_attention"
        if (il + 1) % int(text.get("full_attention_interval", 4)) == 0
        else "linear_attention"
        for il in range(n_layer)
    ]
    rope = text.get("rope_parameters") or {}
    head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // int(text["num_attention_heads"]))
    partial = float(rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25)))
    return Qwen35Config(
        d_model=int(text["hidden_size"]),
        n_layer=n_layer,
        n_vocab=int(raw[emb].shape[0]),
        d_ff=int(text["intermediate_size"]),
        n_head=int(text["num_attention_heads"]),
        n_head_kv=int(text["num_key_value_heads"]),
        head_dim=head_dim,
        recurrent=tuple(kind == "linear_attention" for kind in types),
        d_conv=int(text["linear_conv_kernel_dim"]),
        d_state=int(text["linear_key_head_dim"]),
        n_k_heads=int(text["linear_num_key_heads"]),
        n_v_heads=int(text["linear_num_value_heads"]),
        d_inner=int(text["linear_value_head_dim"]) * int(text["linear_num_value_heads"]),
        n_rot=int(head_dim * partial),
        rope_base=float(rope.get("rope_theta", text.get("rope_theta", 10_000_000.0))),
        rope_sections=(*(int(v) for v in rope.get("mrope_section", (11, 11, 10))), 0),
        eps=float(text.get("rms_norm_eps", 1e-6)),
        n_ctx_train=int(text.get("max_position_embeddings", 262_144)),
    )


def _map(rest: str, t: torch.Tensor, cfg: Qwen35Config) -> tuple[gguf.MODEL_TENSOR, str, torch.Tensor] | None:
    """One layer tensor (name after ``layers.N.``) with the converter's transforms, or None (not used)."""
    if rest.startswith("linear_attn."):
        name = rest.removeprefix("linear_attn.")
        if name not in LINEAR:
            return None
        kind, suffix = LINEAR[name]
        nk, dv, dk = cfg.n_k_heads, cfg.dv, cfg.dk
        if name == "in_proj_qkv.weight":
            qk = 2 * nk * dk
            t = torch.cat([t[:qk], tiled(t[qk:], 0, nk, dv)])
        elif name == "conv1d.weight":
            t = t.squeeze(1)
            qk = 2 * nk * dk
            t = torch.cat([t[:qk], tiled(t[qk:], 0, nk, dv)])
        elif name == "in_proj_z.weight":
            t = tiled(t, 0, nk, dv)
        elif name in ("in_proj_b.weight", "in_proj_a.weight", "dt_bias"):
            t = tiled(t, 0, nk, 1)
        elif name == "A_log":
            t = -torch.exp(tiled(t, 0, nk, 1))
        elif name == "out_proj.weight":
            t = tiled(t, 1, nk, dv)
        return kind, suffix, t
    other = OTHER.get(rest)
    if other is None:
        return None
    if rest.endswith("norm.weight"):
        t = t + 1  # transformers' zero-centred RMS norm weights, as llama.cpp's converter stores them
    return other, ".weight", t


def qwen35_checkpoint(folder: Path, config: dict, raw: dict[str, torch.Tensor]) -> ModelTensors:
    """The folder's tensors (``raw``, by HF name) and ``config.json`` as a llama.cpp-form checkpoint."""
    prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in raw), None)
    if prefix is None:
        raise ModelFormatError(f"{folder}: missing tensor 'model.embed_tokens.weight'")
    try:
        cfg = _config(config, raw, f"{prefix}embed_tokens.weight")
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a count of 0 divided by
        raise ModelFormatError(f"{folder}/config.json: missing or invalid hyperparameter ({exc})") from exc
    if any("mlp.experts" in name for name in raw):
        raise ModelFormatError(f"{folder}: Qwen3.5 with experts (MoE) is not supported")
    tensors = {
        tensor_name(T.TOKEN_EMBD): raw[f"{prefix}embed_tokens.weight"],
        tensor_name(T.OUTPUT_NORM): raw[f"{prefix}norm.weight"] + 1,
    }
    text = config.get("text_config") or {}
    tied = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
    if "lm_head.weight" in raw and not tied:
        tensors[tensor_name(T.OUTPUT)] = raw["lm_head.weight"]
    for name, t in raw.items():
        if not name.startswith(f"{prefix}layers."):
            continue
        bid_text, _, rest = name.removeprefix(f"{prefix}layers.").partition(".")
        mapped = _map(rest, t, cfg)
        if mapped is not None:
            kind, suffix, value = mapped
            tensors[tensor_name(kind, int(bid_text), suffix)] = value
    return ModelTensors(
        arch="qwen35",
        config=cfg,  # type: ignore[arg-type]  # ModelTensors.config names the Mamba configs only
        tensors=tensors,
        tokenizer=tokenizer_data_from_hf(folder, config),
        source=str(folder),
        meta={"hf_config": config},
    )
