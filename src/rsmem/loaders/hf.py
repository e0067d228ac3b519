"""Read an HF folder as transformers saves ``MambaForCausalLM`` / ``Mamba2ForCausalLM`` (config.json,
safetensors, optionally sharded with an index), mapped to llama.cpp's names and transforms."""

from __future__ import annotations

import json
import math
import os
import re
from pathlib import Path

import torch
from safetensors import safe_open

from rsmem.errors import ModelFormatError
from rsmem.loaders.hybrid.hf import HF_HYBRID_ARCHS, hybrid_checkpoint
from rsmem.loaders.hybrid.qwen35 import HF_MODEL_TYPES as QWEN35_MODEL_TYPES
from rsmem.loaders.hybrid.qwen35 import qwen35_checkpoint
from rsmem.loaders.rwkv.hf import is_rwkv7_folder, read_hf_rwkv7
from rsmem.loaders.tensors import ModelTensors, T, tensor_name
from rsmem.loaders.tokenizer import tokenizer_data_from_hf
from rsmem.models.mamba.mamba1 import MambaConfig
from rsmem.models.mamba.mamba2 import Mamba2Config

LAYER = re.compile(r"^backbone\.layers\.(\d+)\.(.+)$")

# HF name inside a layer -> (llama.cpp tensor, suffix)
LAYER_NAMES = {
    "norm.weight": (T.ATTN_NORM, ".weight"),
    "mixer.in_proj.weight": (T.SSM_IN, ".weight"),
    "mixer.conv1d.weight": (T.SSM_CONV1D, ".weight"),
    "mixer.conv1d.bias": (T.SSM_CONV1D, ".bias"),
    "mixer.x_proj.weight": (T.SSM_X, ".weight"),
    "mixer.dt_proj.weight": (T.SSM_DT, ".weight"),
    "mixer.dt_proj.bias": (T.SSM_DT, ".bias"),
    "mixer.dt_bias": (T.SSM_DT, ".bias"),
    "mixer.A_log": (T.SSM_A, ""),
    "mixer.D": (T.SSM_D, ""),
    "mixer.norm.weight": (T.SSM_NORM, ".weight"),
    "mixer.out_proj.weight": (T.SSM_OUT, ".weight"),
}
GLOBAL_NAMES = {
    "backbone.embeddings.weight": tensor_name(T.TOKEN_EMBD),
    "backbone.embedding.weight": tensor_name(T.TOKEN_EMBD),
    "backbone.norm_f.weight": tensor_name(T.OUTPUT_NORM),
    "lm_head.weight": tensor_name(T.OUTPUT),
}


def is_hf_folder(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").exists()


def read_hf(folder: str | os.PathLike[str]) -> ModelTensors:
    """Parse the folder into a :class:`ModelTensors` (ModelFormatError names what is missing or
    unsupported)."""
    folder = Path(folder)
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelFormatError(f"{folder}: unreadable config.json ({exc})") from exc
    arch = config.get("model_type")
    if is_rwkv7_folder(folder):  # RWKV-7 (fla-hub's layout or BlinkDL names): loaders/rwkv/hf.py
        return read_hf_rwkv7(folder)
    if arch in HF_HYBRID_ARCHS:
        return hybrid_checkpoint(folder, config, _read_safetensors(folder))
    if arch in QWEN35_MODEL_TYPES:
        return qwen35_checkpoint(folder, config, _read_safetensors(folder))
    if arch not in ("mamba", "mamba2"):
        raise ModelFormatError(f"{folder}: unsupported architecture {arch!r} (model_type in config.json)")
    if config.get("use_bias"):
        raise ModelFormatError(f"{folder}: in/out projection biases (use_bias) are not supported")
    raw = _read_safetensors(folder)
    tensors = {}
    for name, t in raw.items():
        try:
            mapped = _map(name, t, arch, config)
        except ModelFormatError as exc:
            raise ModelFormatError(f"{folder}/config.json: {exc}") from exc
        if mapped is not None:
            tensors[mapped[0]] = mapped[1]
    out = tensor_name(T.OUTPUT)
    if config.get("tie_word_embeddings", True) and out in tensors:
        del tensors[out]  # tied: llama.cpp omits the output tensor
    emb = tensors.get(tensor_name(T.TOKEN_EMBD))
    if emb is None:
        raise ModelFormatError(f"{folder}: missing tensor 'backbone.embeddings.weight'")
    return ModelTensors(
        arch=arch,
        config=_config(config, arch, emb.shape[0], folder),
        tensors=tensors,
        tokenizer=tokenizer_data_from_hf(folder, config),
        source=str(folder),
        meta={"hf_config": config},
    )


def _read_safetensors(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
    elif (folder / "model.safetensors").exists():
        files = ["model.safetensors"]
    else:
        raise ModelFormatError(f"{folder}: no model.safetensors or model.safetensors.index.json")
    tensors: dict[str, torch.Tensor] = {}
    for fname in files:
        try:
            with safe_open(folder / fname, framework="pt") as f:
                for k in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tensors[k] = f.get_tensor(k).float()
        except Exception as exc:
            raise ModelFormatError(f"{folder / fname}: unreadable safetensors ({exc})") from exc
    return tensors


def _map(name: str, t: torch.Tensor, arch: str, config: dict) -> tuple[str, torch.Tensor] | None:
    """One HF tensor to llama.cpp's name and layout (the transforms of llama.cpp's converter)."""
    if name in GLOBAL_NAMES:
        return GLOBAL_NAMES[name], t
    m = LAYER.match(name)
    if m is None or m.group(2) not in LAYER_NAMES:
        return None
    bid, rest = int(m.group(1)), m.group(2)
    kind, suffix = LAYER_NAMES[rest]
    if rest == "mixer.conv1d.weight":
        t = t.squeeze(1)  # [C, 1, K] -> [C, K]
    elif rest == "mixer.A_log":
        t = -torch.exp(t)
    if arch == "mamba2":
        if rest in ("mixer.A_log", "mixer.D"):
            t = t.reshape(-1, 1)  # [n_head, 1]
        elif rest == "mixer.norm.weight":
            n_group = config.get("n_groups", 1)
            if not isinstance(n_group, int) or n_group < 1 or t.numel() % n_group:
                raise ModelFormatError(f"n_groups {n_group!r} does not split {name} ({t.numel()} values)")
            t = t.reshape(n_group, -1)
    return tensor_name(kind, bid, suffix), t


def _config(config: dict, arch: str, n_vocab: int, folder: Path) -> MambaConfig | Mamba2Config:
    try:
        d_model = int(config["hidden_size"])
        common = {
            "d_model": d_model,
            "n_layer": int(config["num_hidden_layers"]),
            "n_vocab": n_vocab,
            "d_state": int(config["state_size"]),
            "d_conv": int(config["conv_kernel"]),
        }
        eps = float(config.get("layer_norm_epsilon", 1e-5))
        if arch == "mamba":
            rank = config.get("time_step_rank", "auto")
            return MambaConfig(
                **common,
                eps=eps,
                d_inner=int(config.get("intermediate_size") or config.get("expand", 2) * d_model),
                dt_rank=math.ceil(d_model / 16) if rank == "auto" else int(rank),
            )
        return Mamba2Config(
            **common,
            eps=eps,
            d_inner=int(config.get("expand", 2) * d_model),
            n_head=int(config["num_heads"]),
            n_group=int(config.get("n_groups", 1)),
        )
    except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:  # a count of 0 divided by
        raise ModelFormatError(f"{folder}/config.json: missing or invalid hyperparameter ({exc})") from exc
