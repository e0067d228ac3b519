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
from rsmem.loaders.checkpoint import Checkpoint, tensor_name
from rsmem.loaders.checkpoint import metadata_int as _int
from rsmem.loaders.tokenizer import tokenizer_data_from_hf
from rsmem.models.compiled import CompileSetting
from rsmem.models.qwen35 import (
    DeltaNet,
    GatedAttention,
    Qwen35Config,
    Qwen35Layer,
    Qwen35Model,
    Qwen35Weights,
)

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


def _flags(value: object, n_layer: int) -> tuple[bool, ...]:
    if not isinstance(value, list) or len(value) != n_layer:
        raise ModelFormatError(f"attention.recurrent_layers is {value!r}, not {n_layer} flags")
    return tuple(bool(v) for v in value)


def qwen35_config_from_gguf(key: Key, n_vocab: int, optional: Callable[[str], object | None]) -> Qwen35Config:
    """``qwen35.*`` metadata as llama.cpp's ``llama_model_qwen35::load_arch_hparams`` reads it (the layer
    kinds from ``attention.recurrent_layers``, else every ``full_attention_interval``-th is attention). MTP
    layers (``nextn_predict_layers``, the last blocks) are left out: the model is the trunk."""
    if optional("expert_count"):
        raise ModelFormatError("Qwen3.5 with experts (qwen35moe) is not supported")
    n_layer_all = _int(key("block_count"), "block_count")
    n_layer = n_layer_all - _int(optional("nextn_predict_layers") or 0, "nextn_predict_layers")  # MTP: unused
    flags = optional("attention.recurrent_layers")
    if flags is None:
        interval = _int(optional("full_attention_interval") or 4, "full_attention_interval")
        recurrent = tuple((il + 1) % interval != 0 for il in range(n_layer))
    else:
        recurrent = _flags(flags, n_layer_all)[:n_layer]
    head_dim = _int(key("attention.key_length"), "attention.key_length")
    if _int(optional("attention.value_length") or head_dim, "attention.value_length") != head_dim:
        raise ModelFormatError("attention.value_length differs from attention.key_length")
    sections = optional("rope.dimension_sections")
    try:
        return Qwen35Config(
            d_model=_int(key("embedding_length"), "embedding_length"),
            n_layer=n_layer,
            n_vocab=n_vocab,
            d_ff=_int(key("feed_forward_length"), "feed_forward_length"),
            n_head=_int(key("attention.head_count"), "attention.head_count"),
            n_head_kv=_int(key("attention.head_count_kv"), "attention.head_count_kv"),
            head_dim=head_dim,
            recurrent=recurrent,
            d_conv=_int(key("ssm.conv_kernel"), "ssm.conv_kernel"),
            d_state=_int(key("ssm.state_size"), "ssm.state_size"),
            n_k_heads=_int(key("ssm.group_count"), "ssm.group_count"),
            n_v_heads=_int(key("ssm.time_step_rank"), "ssm.time_step_rank"),
            d_inner=_int(key("ssm.inner_size"), "ssm.inner_size"),
            n_rot=_int(optional("rope.dimension_count") or head_dim, "rope.dimension_count"),
            rope_base=float(optional("rope.freq_base") or 10_000.0),  # type: ignore[arg-type]
            rope_sections=tuple(int(v) for v in sections) if isinstance(sections, list) else (),
            eps=float(key("attention.layer_norm_rms_epsilon")),  # type: ignore[arg-type]
            n_ctx_train=_int(optional("context_length") or 262_144, "context_length"),
        )
    except ValueError as exc:
        raise ModelFormatError(f"inconsistent hyperparameters ({exc})") from exc


def build_qwen35(
    ckpt: Checkpoint, dtype: torch.dtype = torch.float32, compile: CompileSetting = None
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


def qwen35_checkpoint(folder: Path, config: dict, raw: dict[str, torch.Tensor]) -> Checkpoint:
    """The folder's tensors (``raw``, by HF name) and ``config.json`` as a llama.cpp-form checkpoint."""
    prefix = next((p for p in PREFIXES if f"{p}embed_tokens.weight" in raw), None)
    if prefix is None:
        raise ModelFormatError(f"{folder}: missing tensor 'model.embed_tokens.weight'")
    try:
        cfg = _config(config, raw, f"{prefix}embed_tokens.weight")
    except (KeyError, TypeError, ValueError) as exc:
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
    return Checkpoint(
        arch="qwen35",
        config=cfg,  # type: ignore[arg-type]  # Checkpoint.config names the Mamba configs only
        tensors=tensors,
        tokenizer=tokenizer_data_from_hf(folder, config),
        source=str(folder),
        meta={"hf_config": config},
    )
