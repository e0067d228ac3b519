"""HF folders of the hybrids (``Lfm2ForCausalLM``, ``NemotronHForCausalLM``) in llama.cpp's form: tensor
names and the transforms of llama.cpp's ``convert_hf_to_gguf.py`` (squeezed conv kernels, ``-exp(A_log)``,
LLaMA's q/k row permutation for Nemotron-H), and the hyperparameters from ``config.json``."""

from __future__ import annotations

import re
from pathlib import Path

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.tensors import ModelTensors, tensor_name
from rsmem.loaders.tokenizer import tokenizer_data_from_hf
from rsmem.models.hybrid.lfm2 import Lfm2Config
from rsmem.models.hybrid.nemotron_h import ATTENTION, MAMBA, MLP, NemotronHConfig

HF_HYBRID_ARCHS = ("lfm2", "nemotron_h")
T = gguf.MODEL_TENSOR
LAYER = re.compile(r"^(?:model|backbone)\.layers\.(\d+)\.(.+)$")

LFM2_NAMES = {
    "operator_norm.weight": T.ATTN_NORM,
    "ffn_norm.weight": T.FFN_NORM,
    "feed_forward.w1.weight": T.FFN_GATE,
    "feed_forward.w3.weight": T.FFN_UP,
    "feed_forward.w2.weight": T.FFN_DOWN,
    "conv.conv.weight": T.SHORTCONV_CONV,
    "conv.in_proj.weight": T.SHORTCONV_INPROJ,
    "conv.out_proj.weight": T.SHORTCONV_OUTPROJ,
    "self_attn.q_proj.weight": T.ATTN_Q,
    "self_attn.k_proj.weight": T.ATTN_K,
    "self_attn.v_proj.weight": T.ATTN_V,
    "self_attn.out_proj.weight": T.ATTN_OUT,
    "self_attn.q_layernorm.weight": T.ATTN_Q_NORM,
    "self_attn.k_layernorm.weight": T.ATTN_K_NORM,
}
NEMOTRON_H_NAMES = {
    "norm.weight": (T.ATTN_NORM, ".weight"),
    "mixer.in_proj.weight": (T.SSM_IN, ".weight"),
    "mixer.conv1d.weight": (T.SSM_CONV1D, ".weight"),
    "mixer.conv1d.bias": (T.SSM_CONV1D, ".bias"),
    "mixer.dt_bias": (T.SSM_DT, ".bias"),
    "mixer.A_log": (T.SSM_A, ""),
    "mixer.D": (T.SSM_D, ""),
    "mixer.norm.weight": (T.SSM_NORM, ".weight"),
    "mixer.out_proj.weight": (T.SSM_OUT, ".weight"),
    "mixer.q_proj.weight": (T.ATTN_Q, ".weight"),
    "mixer.k_proj.weight": (T.ATTN_K, ".weight"),
    "mixer.v_proj.weight": (T.ATTN_V, ".weight"),
    "mixer.o_proj.weight": (T.ATTN_OUT, ".weight"),
    "mixer.up_proj.weight": (T.FFN_UP, ".weight"),
    "mixer.down_proj.weight": (T.FFN_DOWN, ".weight"),
}
GLOBAL_NAMES = {
    "model.embed_tokens.weight": tensor_name(T.TOKEN_EMBD),
    "model.embedding_norm.weight": tensor_name(T.TOKEN_EMBD_NORM),
    "backbone.embeddings.weight": tensor_name(T.TOKEN_EMBD),
    "backbone.norm_f.weight": tensor_name(T.OUTPUT_NORM),
    "lm_head.weight": tensor_name(T.OUTPUT),
}
NEMOTRON_KINDS = {
    "mamba": MAMBA,
    "linear_attention": MAMBA,
    "attention": ATTENTION,
    "full_attention": ATTENTION,
}
NEMOTRON_KINDS["mlp"] = MLP


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """LLaMA's row permutation of a q/k projection (llama.cpp's converter), head by head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hybrid_checkpoint(folder: Path, config: dict, raw: dict[str, torch.Tensor]) -> ModelTensors:
    """The folder's tensors (``raw``, by HF name) and ``config.json`` as a llama.cpp-form checkpoint."""
    arch = str(config.get("model_type"))
    try:
        cfg = _lfm2_config(config, raw) if arch == "lfm2" else _nemotron_h_config(config, raw)
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a count of 0 divided by
        raise ModelFormatError(f"{folder}/config.json: missing or invalid hyperparameter ({exc})") from exc
    tensors: dict[str, torch.Tensor] = {}
    for name, t in raw.items():
        if name in GLOBAL_NAMES:
            tensors[GLOBAL_NAMES[name]] = t
            continue
        m = LAYER.match(name)
        if m is None:
            continue
        bid, rest = int(m.group(1)), m.group(2)
        mapped = _map_lfm2(bid, rest, t) if arch == "lfm2" else _map_nemotron_h(bid, rest, t, cfg)
        if mapped is not None:
            tensors[mapped[0]] = mapped[1]
    if config.get("tie_word_embeddings", False):
        tensors.pop(tensor_name(T.OUTPUT), None)
    return ModelTensors(
        arch=arch,
        config=cfg,  # type: ignore[arg-type]  # ModelTensors.config names the Mamba configs only
        tensors=tensors,
        tokenizer=tokenizer_data_from_hf(folder, config),
        source=str(folder),
        meta={"hf_config": config},
    )


def _map_lfm2(bid: int, rest: str, t: torch.Tensor) -> tuple[str, torch.Tensor] | None:
    kind = LFM2_NAMES.get(rest)
    if kind is None:
        return None
    if kind == T.SHORTCONV_CONV:
        t = t.squeeze(1)  # [C, 1, K] -> [C, K]
    return tensor_name(kind, bid), t


def _map_nemotron_h(
    bid: int, rest: str, t: torch.Tensor, cfg: Lfm2Config | NemotronHConfig
) -> tuple[str, torch.Tensor] | None:
    assert isinstance(cfg, NemotronHConfig)
    entry = NEMOTRON_H_NAMES.get(rest)
    if entry is None:
        return None
    kind, suffix = entry
    if rest == "mixer.conv1d.weight":
        t = t.squeeze(1)
    elif rest == "mixer.A_log":
        t = -torch.exp(t)
    elif rest == "mixer.q_proj.weight":
        t = permute_qk(t, cfg.n_head)
    elif rest == "mixer.k_proj.weight":
        t = permute_qk(t, cfg.n_head_kv[bid])
    return tensor_name(kind, bid, suffix), t


def _lfm2_config(config: dict, raw: dict[str, torch.Tensor]) -> Lfm2Config:
    n_layer = int(config["num_hidden_layers"])
    types = config.get("layer_types")
    if types is None:
        attn = set(config.get("full_attn_idxs") or [])
        types = ["full_attention" if il in attn else "conv" for il in range(n_layer)]
    n_kv = int(config["num_key_value_heads"])
    rope = config.get("rope_parameters") or {}
    return Lfm2Config(
        d_model=int(config["hidden_size"]),
        n_layer=n_layer,
        n_vocab=int(raw["model.embed_tokens.weight"].shape[0]),
        d_ff=int(raw["model.layers.0.feed_forward.w1.weight"].shape[0]),  # after any ff auto-adjust
        n_head=int(config["num_attention_heads"]),
        n_head_kv=tuple(n_kv if kind == "full_attention" else 0 for kind in types),
        l_cache=int(config["conv_L_cache"]),
        rope_base=float(rope.get("rope_theta", config.get("rope_theta", 1_000_000.0))),
        eps=float(config.get("norm_eps", 1e-5)),
        n_ctx_train=int(config.get("max_position_embeddings", 128_000)),
    )


def _nemotron_h_config(config: dict, raw: dict[str, torch.Tensor]) -> NemotronHConfig:
    pattern = config.get("hybrid_override_pattern")
    if pattern is None:
        pattern = "".join(NEMOTRON_KINDS.get(k, "?") for k in config["layers_block_type"])
    if set(pattern) - {MAMBA, ATTENTION, MLP}:
        raise ValueError(
            f"layer kinds {pattern!r}: only Mamba-2 (M), attention (*) and MLP (-) are supported"
        )
    n_kv = int(config["num_key_value_heads"])
    d_ff = int(config["intermediate_size"])
    n_head = int(config["num_attention_heads"])
    d_model = int(config["hidden_size"])
    return NemotronHConfig(
        d_model=d_model,
        n_vocab=int(raw["backbone.embeddings.weight"].shape[0]),
        kinds=pattern,
        d_inner=int(config["mamba_num_heads"]) * int(config["mamba_head_dim"]),
        d_state=int(config["ssm_state_size"]),
        d_conv=int(config["conv_kernel"]),
        n_ssm_head=int(config["mamba_num_heads"]),
        n_group=int(config.get("n_groups", 1)),
        n_head=n_head,
        n_head_kv=tuple(n_kv if k == ATTENTION else 0 for k in pattern),
        head_dim=int(config.get("head_dim") or d_model // n_head),
        d_ff=tuple(d_ff if k == MLP else 0 for k in pattern),
        eps=float(config.get("layer_norm_epsilon", 1e-5)),
    )
