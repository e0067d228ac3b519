"""Load every architecture (Mamba, Mamba-2, RWKV-6, RWKV-7, ARWKV-7, QRWKV-6, LFM2, Nemotron-H, Qwen3.5)
from GGUF files, HF folders or BlinkDL .pth checkpoints, and convert HF folders and .pth files to GGUF."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from rsmem import malloc
from rsmem.errors import ModelFormatError
from rsmem.loaders.convert import convert_hf_to_gguf
from rsmem.loaders.gguf import is_gguf, read_gguf
from rsmem.loaders.hf import is_hf_folder, read_hf
from rsmem.loaders.registry import build_model
from rsmem.loaders.rwkv.convert import convert_blink_to_gguf, is_blink_checkpoint, read_blink
from rsmem.loaders.tensors import ModelTensors
from rsmem.loaders.tokenizer import TokenizerData, build_tokenizer
from rsmem.models.hybrid.lfm2 import Lfm2Model
from rsmem.models.hybrid.nemotron_h import NemotronHModel
from rsmem.models.hybrid.qwen35 import Qwen35Model
from rsmem.models.mamba.mamba1 import MambaModel
from rsmem.models.mamba.mamba2 import Mamba2Model
from rsmem.models.step.compiled import CompileSetting
from rsmem.models.step.packed import packing_enabled
from rsmem.threads import use_threads


def read_tensors(path: str | os.PathLike[str], arena: bool = False) -> ModelTensors:
    """A GGUF file or an HF folder (a ``config.json`` inside it) in llama.cpp's tensor form (``arena``: see
    :func:`~rsmem.loaders.gguf.read_gguf`)."""
    p = Path(path)
    if is_hf_folder(p):
        return read_hf(p)
    if p.is_dir():
        raise ModelFormatError(f"{p}: a folder without config.json is not a model")
    if not p.exists():
        raise ModelFormatError(f"{p}: no such model file")
    if p.name == "config.json":
        return read_hf(p.parent)
    if is_blink_checkpoint(p):  # a BlinkDL RWKV .pth (no tokenizer: see loaders.rwkv_convert)
        return read_blink(p)
    return read_gguf(p, arena)


def load_model(
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype = torch.float32,
    n_threads: int | None = None,
    compile: CompileSetting = None,
) -> MambaModel | Mamba2Model | Lfm2Model | NemotronHModel | Qwen35Model:
    """Load a model; ``model.tokenizer`` is its ``tokenizers.Tokenizer`` when the file carries one.

    ``dtype`` is the matrices' compute dtype (float32 or bfloat16); ``n_threads`` sets torch's intra-op
    thread count (process-wide); None: ``RSMEM_THREADS``, else chosen by the model
    (:func:`rsmem.threads.use_threads`). ``compile``: whether decode steps run through
    ``torch.compile`` -- ``"auto"`` (large models, when a C++ compiler is present), True or False; None
    reads ``RSMEM_COMPILE`` (see :mod:`rsmem.models.step.compiled`).
    """
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    # float32 matrices the model keeps as they are: read straight onto huge pages, the one copy it holds
    ckpt = read_tensors(path, arena=dtype == torch.float32 and packing_enabled())
    model = build_model(ckpt, dtype, compile)
    if ckpt.tokenizer is not None:
        model.tokenizer = build_tokenizer(ckpt.tokenizer)
    del ckpt  # the loader's tensors: the model holds copies of the large ones
    malloc.release_freed()
    use_threads(model, n_threads)
    return model


def load_tokenizer(path: str | os.PathLike[str]) -> Tokenizer | None:
    """The tokenizer stored with a model, or None."""
    data = read_tensors(path).tokenizer
    return None if data is None else build_tokenizer(data)


__all__ = [
    "ModelTensors",
    "TokenizerData",
    "build_model",
    "build_tokenizer",
    "convert_blink_to_gguf",
    "convert_hf_to_gguf",
    "is_gguf",
    "load_model",
    "load_tokenizer",
    "read_tensors",
]
