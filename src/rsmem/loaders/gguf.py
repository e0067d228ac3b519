"""Read GGUF files as llama.cpp's converter writes them (tensor types and their checks: tensor_types.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders import registry
from rsmem.loaders.hparams import field_contents
from rsmem.loaders.registry import SUPPORTED_ARCHS
from rsmem.loaders.tensor_types import keeps_quantized, load_tensors, open_reader
from rsmem.loaders.tensors import ModelTensors, tensor_name
from rsmem.loaders.tokenizer import TokenizerData, tokenizer_data_from_gguf
from rsmem.models.hybrid.lfm2 import Lfm2Config
from rsmem.models.hybrid.nemotron_h import NemotronHConfig
from rsmem.models.hybrid.qwen35 import Qwen35Config
from rsmem.models.mamba.mamba1 import MambaConfig
from rsmem.models.mamba.mamba2 import Mamba2Config
from rsmem.models.ops.quantized import QuantMatrix
from rsmem.models.rwkv.rwkv6 import Rwkv6Config
from rsmem.models.rwkv.rwkv7 import Rwkv7Config


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """True when the file starts with the GGUF magic."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def read_gguf(path: str | os.PathLike[str], arena: bool = False) -> ModelTensors:
    """Parse the file into a :class:`ModelTensors`; ModelFormatError names whatever is wrong with it.
    ``arena``: for a model that keeps float32 matrices as they are (the Mamba family at float32 with
    oneDNN packing), they come on one huge-page mapping (:func:`~rsmem.loaders.tensor_types.load_tensors`)."""
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
    keep = keeps_quantized(str(arch))
    loaded = load_tensors(reader, path, keep=keep, arena=arena and keep)
    tensors = {name: t for name, t in loaded.items() if isinstance(t, torch.Tensor)}
    quantized = {name: t for name, t in loaded.items() if isinstance(t, QuantMatrix)}
    emb = loaded.get(tensor_name(gguf.MODEL_TENSOR.TOKEN_EMBD))
    if emb is None:
        raise ModelFormatError(f"{path}: missing tensor 'token_embd.weight'")
    # ModelTensors.config names the Mamba configs (convert.py reads their fields); a hybrid's rides along
    config: Any = _arch_config(reader, str(arch), emb.shape[0], path)
    return ModelTensors(
        arch=str(arch),
        config=config,
        tensors=tensors,
        quantized=quantized,
        tokenizer=_tokenizer(reader, emb.shape[0], path),
        source=str(path),
    )


def _tokenizer(reader: gguf.GGUFReader, n_vocab: int, path: Path) -> TokenizerData | None:
    try:
        data = tokenizer_data_from_gguf(reader, n_vocab)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{path}: {exc}") from exc
    if data is not None:
        data.source = str(path)
    return data


def _value(reader: gguf.GGUFReader, key: str, path: Path | None = None) -> object:
    """A metadata value; ModelFormatError (naming ``path`` when given) if the key is missing or its value
    does not decode (a string that is not UTF-8)."""
    where = f"{path}: " if path is not None else ""
    field = reader.fields.get(key)
    if field is None:
        raise ModelFormatError(f"{where}missing metadata key {key!r}")
    try:
        return field_contents(field, key)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{where}{exc}") from exc


def _arch_config(
    reader: gguf.GGUFReader, arch: str, n_vocab: int, path: Path
) -> MambaConfig | Mamba2Config | Lfm2Config | NemotronHConfig | Qwen35Config | Rwkv7Config | Rwkv6Config:
    """The architecture's config from its ``{arch}.*`` keys; every refusal names the file and the key."""

    def key(k: str) -> object:
        return _value(reader, f"{arch}.{k}")

    def optional(k: str) -> object | None:
        field = reader.fields.get(f"{arch}.{k}")
        return None if field is None else field_contents(field, f"{arch}.{k}")

    try:
        return registry.arch(arch).config_from_gguf(arch, key, n_vocab, optional)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{path}: {exc}") from exc
