"""The common form every loader produces: llama.cpp's tensor names and layouts, plus the hyperparameters.

GGUF files already hold this form; HF folders are mapped into it (``hf.py``), so one builder (``registry``)
makes the
models and one writer makes GGUF files (``convert.py``). Names come from ``gguf.TENSOR_NAMES``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import gguf
import torch

from rsmem.errors import ModelFormatError
from rsmem.loaders.tokenizer import TokenizerData
from rsmem.models.ops.quantized import QuantMatrix

if TYPE_CHECKING:
    from rsmem.models.mamba.mamba1 import MambaConfig
    from rsmem.models.mamba.mamba2 import Mamba2Config

T = gguf.MODEL_TENSOR


def tensor_name(kind: gguf.MODEL_TENSOR, bid: int | None = None, suffix: str = ".weight") -> str:
    """llama.cpp's name of a tensor, e.g. ``blk.3.ssm_in.weight``; ``ssm_a`` and ``ssm_d`` have no suffix."""
    base = gguf.TENSOR_NAMES[kind]
    return (base.format(bid=bid) if bid is not None else base) + suffix


@dataclass(slots=True)
class ModelTensors:
    """A model in llama.cpp's form: ``tensors`` maps GGUF names to float tensors in numpy (``[out, in]``)
    order, with llama.cpp's transforms applied (``ssm_a = -exp(A_log)``, squeezed conv kernels, ...)."""

    arch: str
    config: MambaConfig | Mamba2Config
    tensors: dict[str, torch.Tensor]
    tokenizer: TokenizerData | None = None
    source: str = ""
    meta: dict[str, object] = field(default_factory=dict)
    # matrices kept in their quantized blocks (GGUF files of architectures that multiply them), by name
    quantized: dict[str, QuantMatrix] = field(default_factory=dict)

    def __contains__(self, name: str) -> bool:
        return name in self.tensors or name in self.quantized

    def get(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor:
        """The tensor ``name`` as float32 (a matrix kept quantized is dequantized; reshaped to ``shape`` if
        given); ModelFormatError if absent or mis-sized."""
        t = self.get_matrix(name, shape)
        return t.dequantize() if isinstance(t, QuantMatrix) else t

    def get_matrix(self, name: str, shape: tuple[int, ...] | None = None) -> torch.Tensor | QuantMatrix:
        """:meth:`get`, keeping a quantized matrix in its blocks (for models that multiply them)."""
        t: torch.Tensor | QuantMatrix | None = self.quantized.get(name, self.tensors.get(name))
        if t is None:
            raise ModelFormatError(f"{self.source}: missing tensor {name!r} ({self.arch})")
        if shape is not None:
            if t.numel() != _numel(shape) or (isinstance(t, QuantMatrix) and t.shape != shape):
                raise ModelFormatError(
                    f"{self.source}: tensor {name!r} has shape {tuple(t.shape)}, expected {shape}"
                )
            t = t.reshape(shape)
        return t


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
