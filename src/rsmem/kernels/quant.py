"""Products with matrices held in GGUF block form: ``qmatmul(x, blocks, qtype, k) = x @ W.T``.

``W`` is ``N`` rows of ``K`` values stored as a uint8 tensor ``[N, row_bytes]`` of ggml blocks
(:mod:`rsmem.kernels.formats`). :func:`qmatmul` is the torch op ``torch.ops.rsmem.qmatmul`` (registered
when this module is imported, with a fake implementation, so a ``torch.compile(fullgraph=True)`` function
may call it: the compiled graph calls the op as one opaque kernel). On CPU it runs the C++ kernels of
``csrc/`` (:mod:`rsmem.kernels.build`: built at first use, cached; once loaded they are the op's CPU
kernel, so a call no longer passes through Python), else, when kernels are disabled (``RSMEM_KERNELS=0``,
read at first use) or failed to build (warned once), and on other devices, :func:`qmatmul_ref`.

Routes by the number of activation rows ``M`` (the C++ side, ``csrc/qmatmul.cpp``):

- Q4_K, Q5_K, Q6_K on CPUs with AVX512-VNNI, every ``M``: activations quantized to 8 bits per block of
  256 values once per product, as llama.cpp's Q8_K (``d = amax / 127``), and integer dot products with the
  blocks' own integers: what llama.cpp computes for these types. Few rows (``csrc/int8.h``, route 3):
  blocks unpacked in registers (vpmaddubsw, vpdpwssd), never dequantized into memory;
  more rows (Q4_K / Q5_K from 7, Q6_K from 25; ``csrc/int8_gemm.h``, route 4): 16 weight rows repacked
  per task into 4-value groups, vpdpbusd, ahead of the bf16 route at every M. Their twin: the Q8_K-quantized
  activations times the dequantized weights (to ~1e-7 of ``sum |x w|``, tests/kernels/test_int8_route.py).
- Q8_0 and Q4_0 on CPUs with AVX512-VNNI, rows of whole 256-value blocks (``k % 256 == 0``), every ``M``:
  activations quantized per 32 values as llama.cpp's Q8_0 (what llama.cpp multiplies these types with),
  integer dot products: in registers up to 8 rows (``csrc/int8_small.h``, ahead of route 0's float32
  dequantization), on the panels beyond. Their twin: the same with 32-value blocks.
- Otherwise, ``M <= 8`` (one-sequence decode, small batches): blocks are dequantized in registers and
  multiplied with the float32 activations: the reference's values, only the summation order differs
  (~1e-6 of ``sum |x w|``).
- Otherwise, larger ``M`` (large batches, prefill), on CPUs with AVX512-BF16: activations are rounded to
  bfloat16, tiles of 64 weight rows dequantized to bfloat16 in cache, and multiplied with float32 sums
  (vdpbf16ps), ahead of the float32 GEMM; the error is below what llama.cpp's own 8-bit activation
  quantization gives (tests/kernels check that).
- Otherwise, larger ``M`` without AVX512-BF16: tiles dequantized to float32 and torch's GEMM (the
  reference's values).
- F16 and BF16 (``csrc/half_routes.h``), every CPU: the 2-byte values widened to float32 as they are used,
  float32 activations and sums (the widened-float32 product up to summation order, ~1e-7 of
  ``sum |x w|``). Up to 32 rows the weights stream once through registers (``csrc/rows_kernel.h``, the
  few-row float32 kernel's code with widening loads, ahead of oneDNN's float32 product at these rows); more
  rows (prefill) widen chunks of rows to float32 for oneDNN's GEMM (close to the float32 packed product).

:func:`qmatmul_ref` is the plain reference twin: dequantize (:func:`dequantize_rows`, gguf's values) in
row tiles, so that no float32 copy of a whole large matrix is made at once, and ``x @ tile.T``.
"""

from __future__ import annotations

import torch

from rsmem.kernels.build import native_ops
from rsmem.kernels.dequant import dequantize_rows
from rsmem.kernels.formats import KERNEL_TYPES, check_blocks, check_matmul

__all__ = ["KERNEL_TYPES", "dequantize_rows", "kernels_active", "qmatmul", "qmatmul_ref"]

# float32 values the reference dequantizes at once (4 MiB)
REF_TILE_VALUES = 1 << 20


def qmatmul_ref(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The reference twin of :func:`qmatmul`: ``x @ dequantize_rows(blocks).T``, in tiles of rows."""
    check_matmul(x, blocks, qtype, k)
    n = blocks.shape[0]
    out = torch.empty(x.shape[0], n, dtype=torch.float32, device=x.device)
    rows = max(1, REF_TILE_VALUES // k)
    for n0 in range(0, n, rows):
        w = dequantize_rows(blocks[n0 : n0 + rows], qtype, k)
        torch.matmul(x, w.T, out=out[:, n0 : n0 + rows])
    return out


def kernels_active() -> bool:
    """Whether :func:`qmatmul` runs the C++ kernels on CPU (builds them on first call)."""
    return native_ops() is not None


def _qmatmul_impl(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """rsmem::qmatmul until the C++ kernels are loaded (their build registers their own CPU kernel for the
    op, which then takes CPU calls directly), and on other devices or without kernels: the reference."""
    check_matmul(x, blocks, qtype, k)
    ops = native_ops() if x.device.type == "cpu" and blocks.device.type == "cpu" else None
    if ops is None:
        return qmatmul_ref(x, blocks, qtype, k)
    return ops.qmatmul(x, blocks, qtype, k, -1)


def _qmatmul_fake(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    check_blocks(blocks, qtype, k)
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must be a float32 [M, {k}] tensor, got {x.dtype} of shape {tuple(x.shape)}")
    return x.new_empty((x.shape[0], blocks.shape[0]))


_lib = torch.library.Library("rsmem", "DEF")
_lib.define("qmatmul(Tensor x, Tensor blocks, int qtype, int k) -> Tensor")
_lib.impl("qmatmul", _qmatmul_impl, "CompositeExplicitAutograd")
torch.library.register_fake("rsmem::qmatmul", _qmatmul_fake, lib=_lib)


def qmatmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``x @ W.T`` for float32 ``x [M, k]`` and ``W`` as ``blocks [N, row_bytes]`` of ``qtype``: float32
    ``[M, N]``. ValueError for a type without a kernel, a ``k`` that is not a multiple of its block size,
    rows of the wrong length or ``x`` not float32 ``[M, k]``."""
    return torch.ops.rsmem.qmatmul(x, blocks, int(qtype), k)
