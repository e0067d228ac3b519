"""How a matrix is handed to a C++ step op: ``(tensor, qtype)``, a float32 ``[out, in]`` matrix with
contiguous rows (-1), its oneDNN packed twin (:data:`PACKED_F32`), its packed row slices
(:data:`SLICED_F32`) or a GGUF file's blocks (their ggml type)."""

from __future__ import annotations

import itertools
from typing import Any

import gguf
import torch

from rsmem.models.ops.quantized import QuantMatrix
from rsmem.models.step.fused import SmallRows
from rsmem.models.step.packed import PACK_ROWS

# qtype of a float32 matrix given as its oneDNN packed twin (csrc/step_common.h's kPackedF32)
PACKED_F32 = -2
# qtypes whose products keep float32 activations: float32 rows (-1), packed float32, F16, BF16
FLOAT_QTYPES = (-1, PACKED_F32, int(gguf.GGMLQuantizationType.F16), int(gguf.GGMLQuantizationType.BF16))
# qtype of a float32 matrix whose products run through oneDNN packed slices of its rows, one slice a range of
# rsmem's workers on one OpenMP thread each (csrc/step_common.h's kSlicedF32), for ops made with
# ``sliced=True`` (RWKV-6 and RWKV-7) ...
SLICED_F32 = -3


def native_matrix(matrix: Any, packed: bool = False) -> tuple[torch.Tensor, int] | None:
    """A one-sequence operand (:func:`~rsmem.models.step.small_rows.one_operand`) as the op takes it:
    ``(float32 [out, in] with contiguous rows, -1)`` or ``(blocks, qtype)``; with ``packed``, a matrix with
    a oneDNN twin as ``(twin, PACKED_F32)``; None for any other."""
    if isinstance(matrix, QuantMatrix):
        return matrix.blocks, matrix.qtype
    if packed and isinstance(matrix, SmallRows) and matrix.packed.is_mkldnn:  # else no twin: plain rows
        return matrix.packed, PACKED_F32
    w = matrix.plain if isinstance(matrix, SmallRows) else matrix
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.stride(1) == 1:
        return w, -1
    return None


def taken_matrix(matrix: Any, packed: bool = False) -> tuple[torch.Tensor, int]:
    """:func:`native_matrix` of a matrix the op must take
    (:meth:`~rsmem.models.step.native.NativeStep.accepts` said so)."""
    found = native_matrix(matrix, packed)
    if found is None:
        raise ValueError(f"the C++ step takes no {type(matrix).__name__} of this layout as a matrix")
    return found


def matrix_qtype(matrix: Any) -> int | None:
    found = native_matrix(matrix)
    return None if found is None else found[1]


def row_slices(plain: torch.Tensor, n: int) -> list[torch.Tensor]:
    """oneDNN packed twins of ``n`` consecutive row ranges of a float32 ``[out, in]`` matrix, as even as the
    rows allow (the op's ``slices`` for a :data:`SLICED_F32` matrix)."""
    bounds = [plain.shape[0] * i // n for i in range(n + 1)]
    return [
        torch.ops.mkldnn._reorder_linear_weight(plain[a:b].contiguous(), PACK_ROWS)
        for a, b in itertools.pairwise(bounds)
        if b > a
    ]
