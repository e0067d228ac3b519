"""Matrices kept in a GGUF file's quantized block form, and the products models take with them.

A :class:`QuantMatrix` holds the rows of a ``[out, in]`` matrix exactly as the file stores them (ggml's
blocks: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, or F16 / BF16 values, 2 bytes each; one ``uint8`` row of
``row_bytes`` per output), so a model's resident weights are the file's bytes. Its product ``x @ W.T`` runs
through :mod:`rsmem.kernels` (C++ kernels that dequantize or widen in registers, or their reference twin:
dequantize, then matmul), and an embedding lookup dequantizes only the rows it reads.

Where a model holds a float matrix as ``[in, out]`` (see :mod:`rsmem.models.step.packed`) it can hold a
QuantMatrix instead: :func:`~rsmem.models.ops.common.linear` and the compiled steps'
:func:`~rsmem.models.step.fused.gemv` both send it to :meth:`QuantMatrix.matmul_t`, and :func:`out_in` gives
the ``[out, in]`` form the compiled steps take of either kind.
"""

from __future__ import annotations

from typing import TypeAlias

import gguf
import torch

from rsmem.kernels import formats
from rsmem.kernels.build import native_ops
from rsmem.kernels.dequant import dequantize_rows
from rsmem.kernels.quant import qmatmul  # the C++ kernels are built at the first product


class QuantMatrix:
    """A ``[out, in]`` matrix in quantized blocks: ``blocks`` ``uint8 [out, row_bytes]``, ``qtype`` a
    ``gguf.GGMLQuantizationType`` value with a kernel (:data:`rsmem.kernels.formats.MATRIX_TYPES`)."""

    __slots__ = ("blocks", "qtype", "shape")

    def __init__(self, blocks: torch.Tensor, qtype: int, shape: tuple[int, int]) -> None:
        formats.check_blocks(blocks, int(qtype), shape[1])
        if blocks.shape[0] != shape[0]:
            raise ValueError(f"{blocks.shape[0]} rows of blocks for a matrix of {shape[0]} rows")
        self.blocks = blocks
        self.qtype = int(qtype)
        self.shape = (int(shape[0]), int(shape[1]))

    def __repr__(self) -> str:
        return f"QuantMatrix({gguf.GGMLQuantizationType(self.qtype).name}, shape={self.shape})"

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    @property
    def nbytes(self) -> int:
        return self.blocks.numel() * self.blocks.element_size()

    def matmul_t(self, x: torch.Tensor) -> torch.Tensor:
        """``x @ W.T`` for float32 ``x`` ``[..., in]``: ``[..., out]`` float32."""
        flat = x.reshape(-1, self.shape[1])
        if flat.dtype != torch.float32:
            flat = flat.float()
        out = qmatmul(flat.contiguous(), self.blocks, self.qtype, self.shape[1])
        return out.view(*x.shape[:-1], self.shape[0])

    def rows(self, index: torch.Tensor) -> torch.Tensor:
        """The float32 rows ``index`` (any shape of row numbers): ``[*index.shape, in]``, as an embedding.
        The C++ kernels' decoder where they are loaded (the same values as the torch one, without the
        torch decoder's per-call overhead, which dominates a decode step's embedding), else the torch one."""
        picked = self.blocks.index_select(0, index.reshape(-1))
        ops = native_ops() if picked.device.type == "cpu" else None
        if ops is not None:
            got = ops.dequantize(picked, self.qtype, self.shape[1])
        else:
            got = dequantize_rows(picked, self.qtype, self.shape[1])
        return got.view(*index.shape, self.shape[1])

    def dequantize(self) -> torch.Tensor:
        """The whole matrix as float32 ``[out, in]`` (tests, conversions; models never need it)."""
        return dequantize_rows(self.blocks, self.qtype, self.shape[1])

    def reshape(self, shape: tuple[int, ...]) -> QuantMatrix:
        """Itself when ``shape`` is its own (loaders check shapes so); a matrix of blocks has no other."""
        if tuple(shape) != self.shape:
            raise ValueError(f"a quantized {self.shape} matrix cannot be viewed as {tuple(shape)}")
        return self


Matrix: TypeAlias = torch.Tensor | QuantMatrix


def out_in(matrix: Matrix) -> Matrix:
    """The ``[out, in]`` form of a matrix a model holds ``[in, out]`` (a transposed view), or the
    QuantMatrix itself (it is ``[out, in]`` already and its product is always ``x @ W.T``)."""
    return matrix if isinstance(matrix, QuantMatrix) else matrix.t()


def as_float32(matrix: Matrix) -> Matrix:
    """A float matrix as float32; a QuantMatrix as it is."""
    return matrix if isinstance(matrix, QuantMatrix) else matrix.to(torch.float32)


def same_storage(a: Matrix, b: Matrix) -> bool:
    """Whether two held matrices are one (a tied head: the same QuantMatrix, or views of one tensor)."""
    if isinstance(a, QuantMatrix) or isinstance(b, QuantMatrix):
        return a is b
    return a.data_ptr() == b.data_ptr()


def embed(embedding: Matrix, tokens: torch.Tensor) -> torch.Tensor:
    """Rows of the embedding for ``tokens``: a fresh float32 tensor ``[*tokens.shape, d_model]``."""
    if isinstance(embedding, QuantMatrix):
        return embedding.rows(tokens)
    return embedding[tokens]


def matrix_bytes(matrix: Matrix) -> int:
    """Bytes a matrix holds in memory (a view counts its own elements)."""
    if isinstance(matrix, QuantMatrix):
        return matrix.nbytes
    return matrix.numel() * matrix.element_size()
