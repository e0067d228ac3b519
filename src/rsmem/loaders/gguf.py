"""Read GGUF files as llama.cpp's converter writes them (tensor types and their checks: tensor_types.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.checkpoint import SUPPORTED_ARCHS, Checkpoint, tensor_name
from rsmem.loaders.hybrid import HYBRID_ARCHS, config_from_gguf
from rsmem.loaders.rwkv import RWKV_ARCHS
from rsmem.loaders.rwkv import config_from_gguf as rwkv_config_from_gguf
from rsmem.loaders.tensor_types import keeps_quantized, load_tensors, open_reader
from rsmem.loaders.tokenizer import tokenizer_data_from_gguf
from rsmem.models.lfm2 import Lfm2Config
from rsmem.models.mamba import MambaConfig
from rsmem.models.mamba2 import Mamba2Config
from rsmem.models.nemotron_h import NemotronHConfig
from rsmem.models.ops.quantized import QuantMatrix
from rsmem.models.qwen35 import Qwen35Config
from rsmem.models.rwkv6 import Rwkv6Config
from rsmem.models.rwkv7 import Rwkv7Config


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when the file starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf(path: str | os.PathLike[str]) -> Checkpoint:
    """Parse the file into a :class:`Checkpoint`; ModelFormatError names whatever is wrong with it."""
    path = Path(path)
    if not is_gguf(path):
        raise ModelFormatError(f"{path}: not a GGUF file (bad magic)")
    try:
        reader = open_reader(path)
    except ModelFormatError:
        raise
    except Exception as exc:  # the reader raises many types on truncated or corrupt files
        raise ModelFormatError(f"{path}: unreadable GGUF file ({type(exc).__name__}: {exc})") from exc
    arch = _value(reader, "general.architecture", path)
    if arch not in SUPPORTED_ARCHS:
        raise ModelFormatError(f"{path}: unsupported architecture {arch!r} (supported: {SUPPORTED_ARCHS})")
    loaded = load_tensors(reader, path, keep=keeps_quantized(str(arch)))
    tensors = {name: t for name, t in loaded.items() if isinstance(t, torch.Tensor)}
    quantized = {name: t for name, t in loaded.items() if isinstance(t, QuantMatrix)}
    emb = loaded.get(tensor_name(gguf.MODEL_TENSOR.TOKEN_EMBD))
    if emb is None:
        raise ModelFormatError(f"{path}: missing tensor 'token_embd.weight'")
    # Checkpoint.config names the Mamba configs (convert.py reads their fields); a hybrid's rides along
    config: Any = (
        _hybrid_config(reader, str(arch), emb.shape[0], path)
        if arch in HYBRID_ARCHS or arch in RWKV_ARCHS
        else _config(reader, str(arch), emb.shape[0], path)
    )
    return Checkpoint(
        arch=str(arch),
        config=config,
        tensors=tensors,
        quantized=quantized,
        tokenizer=tokenizer_data_from_gguf(reader),
        source=str(path),
    )


def _value(reader: gguf.GGUFReader, key: str, path: Path) -> object:
    field = reader.fields.get(key)
    if field is None:
        raise ModelFormatError(f"{path}: missing metadata key {key!r}")
    return field.contents()


def _number(reader: gguf.GGUFReader, key: str, path: Path) -> int | float:
    value = _value(reader, key, path)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ModelFormatError(f"{path}: metadata key {key!r} is {value!r}, not a number")
    return value


def _config(reader: gguf.GGUFReader, arch: str, n_vocab: int, path: Path) -> MambaConfig | Mamba2Config:
    def key(k: str) -> int:
        return int(_number(reader, f"{arch}.{k}", path))

    common = {
        "d_model": key("embedding_length"),
        "n_layer": key("block_count"),
        "n_vocab": n_vocab,
        "d_state": key("ssm.state_size"),
        "d_conv": key("ssm.conv_kernel"),
        "d_inner": key("ssm.inner_size"),
    }
    eps = float(_number(reader, f"{arch}.attention.layer_norm_rms_epsilon", path))
    try:
        if arch == "mamba":
            return MambaConfig(**common, eps=eps, dt_rank=key("ssm.time_step_rank"))
        return Mamba2Config(
            **common, eps=eps, n_head=key("ssm.time_step_rank"), n_group=key("ssm.group_count")
        )
    except ValueError as exc:
        raise ModelFormatError(f"{path}: inconsistent hyperparameters ({exc})") from exc


def _hybrid_config(
    reader: gguf.GGUFReader, arch: str, n_vocab: int, path: Path
) -> Lfm2Config | NemotronHConfig | Qwen35Config | Rwkv7Config | Rwkv6Config:
    def optional(k: str) -> object | None:
        field = reader.fields.get(f"{arch}.{k}")
        return None if field is None else field.contents()

    get_config = rwkv_config_from_gguf if arch in RWKV_ARCHS else config_from_gguf
    try:
        return get_config(arch, lambda k: _value(reader, f"{arch}.{k}", path), n_vocab, optional)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{path}: {exc}") from exc
