"""Read GGUF files as llama.cpp's converter writes them (tensor types and their checks: tensor_types.py)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.checkpoint import SUPPORTED_ARCHS, Checkpoint, tensor_name
from rsmem.loaders.hparams import Hparams, consistent, field_contents
from rsmem.loaders.hybrid import HYBRID_ARCHS, config_from_gguf
from rsmem.loaders.rwkv import RWKV_ARCHS
from rsmem.loaders.rwkv import config_from_gguf as rwkv_config_from_gguf
from rsmem.loaders.tensor_types import keeps_quantized, load_tensors, open_reader
from rsmem.loaders.tokenizer import TokenizerData, tokenizer_data_from_gguf
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
    config: Any = _arch_config(reader, str(arch), emb.shape[0], path)
    return Checkpoint(
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


def _config(keys: Hparams, n_vocab: int) -> MambaConfig | Mamba2Config:
    """Mamba's or Mamba-2's hyperparameters, each in its range (see ``hparams.py``)."""
    common = {
        "d_model": keys.count("embedding_length"),
        "n_layer": keys.count("block_count"),
        "n_vocab": n_vocab,
        "d_state": keys.count("ssm.state_size"),
        "d_conv": keys.count("ssm.conv_kernel"),
        "d_inner": keys.count("ssm.inner_size"),
    }
    eps = keys.epsilon("attention.layer_norm_rms_epsilon")
    if keys.arch == "mamba":
        return MambaConfig(**common, eps=eps, dt_rank=keys.count("ssm.time_step_rank"))
    n_head, n_group = keys.count("ssm.time_step_rank"), keys.count("ssm.group_count")
    keys.divides("ssm.time_step_rank", n_head, "ssm.inner_size", common["d_inner"])
    keys.divides("ssm.group_count", n_group, "ssm.time_step_rank", n_head)
    return Mamba2Config(**common, eps=eps, n_head=n_head, n_group=n_group)


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
        if arch in RWKV_ARCHS:
            return rwkv_config_from_gguf(arch, key, n_vocab, optional)
        if arch in HYBRID_ARCHS:
            return config_from_gguf(arch, key, n_vocab, optional)
        with consistent():
            return _config(Hparams(arch, key, optional), n_vocab)
    except ModelFormatError as exc:
        raise ModelFormatError(f"{path}: {exc}") from exc
