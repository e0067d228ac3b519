"""Kernels for matrices held in GGUF block form (Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) and as 2-byte floats
(F16, BF16): see :mod:`rsmem.kernels.quant`."""

from rsmem.kernels.formats import HALF_TYPES, KERNEL_TYPES, MATRIX_TYPES, row_bytes
from rsmem.kernels.quant import dequantize_rows, kernels_active, qmatmul, qmatmul_ref

__all__ = [
    "HALF_TYPES",
    "KERNEL_TYPES",
    "MATRIX_TYPES",
    "dequantize_rows",
    "kernels_active",
    "qmatmul",
    "qmatmul_ref",
    "row_bytes",
]
