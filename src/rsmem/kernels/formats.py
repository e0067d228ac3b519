"""The GGUF block layouts rsmem multiplies in block form, and the one check of a matrix's blocks.

A matrix of ``N`` rows and ``K`` columns is held as a uint8 tensor ``[N, row_bytes]``: each row is the
``K / block_size`` blocks of its values, byte for byte as the GGUF file stores them (ggml's layouts:
``ggml-common.h``). ``row_bytes = K / block_size * type_size``.

======== ===== ===== ===================================================================================
type     block bytes layout (values of one block)
======== ===== ===== ===================================================================================
Q8_0     32    34    f16 d, 32 x int8 q: ``d * q``
Q4_0     32    18    f16 d, 16 bytes: value i < 16 is the low nibble of byte i, value 16 + i its high
                     nibble: ``d * (q - 8)``
Q4_K     256   144   f16 d, f16 dmin, 12 bytes of eight 6-bit scales and mins, 128 bytes of nibbles (each
                     32 bytes: 32 values in the low nibbles, the next 32 in the high ones):
                     ``d * sc * q - dmin * m`` per sub-block of 32
Q5_K     256   176   as Q4_K with 32 bytes of fifth bits (bit j of byte i: value i of sub-block j) before
                     the nibbles
Q6_K     256   210   128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8 scales, f16 d:
                     ``d * sc * (q - 32)`` per sub-block of 16
F16      1     2     an IEEE half (widened to float32 exactly)
BF16     1     2     a bfloat16: the high 16 bits of its float32
======== ===== ===== ===================================================================================

F16 and BF16 rows are the file's 2-byte values, ``row_bytes = 2 * K`` (any ``K``); their products widen
them to float32 as they are used (:data:`HALF_TYPES`).
"""

from __future__ import annotations

import gguf
import torch

Q = gguf.GGMLQuantizationType

# The types kept in block form and multiplied by rsmem.kernels.
KERNEL_TYPES: tuple[gguf.GGMLQuantizationType, ...] = (Q.Q8_0, Q.Q4_0, Q.Q4_K, Q.Q5_K, Q.Q6_K)
# The float types kept as stored: 2-byte values, multiplied as float32 (only the summation order differs
# from the float32 product with the widened matrix).
HALF_TYPES: tuple[gguf.GGMLQuantizationType, ...] = (Q.F16, Q.BF16)
# Every type a matrix multiplied by rsmem.kernels may have.
MATRIX_TYPES: tuple[gguf.GGMLQuantizationType, ...] = KERNEL_TYPES + HALF_TYPES


def block_shape(qtype: int) -> tuple[int, int]:
    """``(values per block, bytes per block)`` of a kernel type (:data:`MATRIX_TYPES`); ValueError for any
    other type."""
    if qtype not in MATRIX_TYPES:
        names = ", ".join(t.name for t in MATRIX_TYPES)
        raise ValueError(f"qtype {qtype!r} has no kernel (kernel types: {names})")
    block_size, type_size = gguf.GGML_QUANT_SIZES[Q(qtype)]
    return block_size, type_size


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one row of ``k`` values; ValueError when ``k`` is not a positive multiple of the block."""
    block_size, type_size = block_shape(qtype)
    if k <= 0 or k % block_size:
        raise ValueError(f"k={k} is not a positive multiple of {Q(qtype).name}'s block size {block_size}")
    return k // block_size * type_size


def check_blocks(blocks: torch.Tensor, qtype: int, k: int) -> None:
    """The one check of a matrix in block form: uint8, 2-D, contiguous, rows of ``row_bytes(qtype, k)``."""
    expected = row_bytes(qtype, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2:
        raise ValueError(
            f"blocks must be a 2-D uint8 tensor [N, row_bytes], got {blocks.dtype} of shape "
            f"{tuple(blocks.shape)}"
        )
    if blocks.shape[1] != expected:
        raise ValueError(
            f"blocks have row_bytes={blocks.shape[1]}, but {Q(qtype).name} rows of k={k} values take "
            f"{expected} bytes"
        )
    if not blocks.is_contiguous():
        raise ValueError("blocks must be contiguous (rows as the GGUF stores them)")


def check_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> None:
    """:func:`check_blocks` and the activations: float32 ``[M, k]``."""
    check_blocks(blocks, qtype, k)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be a float32 [M, {k}] tensor, got {x.dtype} of shape {tuple(x.shape)}")
