"""Products of a few float32 rows with a model's ``[out, in]`` matrix through the C++ kernel
``csrc/rows_f32.cpp`` (``rsmem_native::rows_f32``), for batched decode steps of 2-16 sequences.

At a few rows oneDNN's packed product reads the weights at under half the one-row rate; the kernel streams the
weights once with every row's inner products in registers and prefetches ahead, so a few rows cost little more
than one. Beyond 16 rows oneDNN's blocked product is faster, so :class:`SmallRows` carries both the plain
matrix and its packed twin and ``rsmem_native::rows_linear`` picks by the row count inside one op (a compiled
step with a dynamic batch needs no guard on it).

- :func:`rows_ref`: the plain reference twin, ``x @ w.t()``.
- :func:`rows_f32`: the kernel when the native kernels are built (:func:`~rsmem.kernels.build.native_ops`),
  else the twin.
- :func:`rows_operand`: how a batched step takes a float32 matrix with a packed twin: a
  :class:`~rsmem.models.step.fused.SmallRows`
  when the kernels are loaded, else :class:`~rsmem.models.step.fused.Packed` (oneDNN for every row count).
- :func:`many_operand` and :func:`one_operand`: a model's held ``[in, out]`` matrix as its steps for several
  sequences and for one take it (the one rule every model follows).
- :func:`~rsmem.models.step.fused.matmul_rows` multiplies by either (it dispatches :class:`SmallRows`).
"""

from __future__ import annotations

import threading
from typing import Any, overload

import torch

from rsmem.kernels.build import native_ops
from rsmem.models.ops.quantized import Matrix, out_in
from rsmem.models.step.fused import Packed, RowsOperand, SmallRows

# Rows up to which the kernel runs (more go to oneDNN's packed product): at 16 rows the two are about even.
MAX_ROWS = 16

_lock = threading.Lock()
_faked: set[str] = set()


def rows_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.t()``: ``x`` ``[M, in]``, ``w`` ``[out, in]``, float32 (the kernel's reference twin)."""
    return x @ w.t()


def _rows_fake(x: torch.Tensor, w: torch.Tensor, *_: Any) -> torch.Tensor:
    return x.new_empty((x.shape[0], w.shape[0]))


def kernel_ops(namespace: str = "rsmem_native") -> Any:
    """The native ops with fake implementations registered for ``rows_f32`` and ``rows_linear`` (so compiled
    graphs can call them), or None when the kernels are not built. ``namespace``: another build's ops (the
    tests' portable build)."""
    ops = native_ops() if namespace == "rsmem_native" else getattr(torch.ops, namespace, None)
    if ops is None or not hasattr(ops, "rows_linear"):
        return None
    if namespace not in _faked:
        with _lock:
            if namespace not in _faked:
                for name in ("rows_f32", "rows_linear"):
                    torch.library.register_fake(f"{namespace}::{name}", _rows_fake)
                _faked.add(namespace)
    return ops


def rows_f32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``x @ w.t()`` through the kernel (float32 CPU tensors, ``w``'s rows contiguous), else the twin."""
    ops = kernel_ops()
    if ops is None or x.dtype != torch.float32 or w.dtype != torch.float32 or w.stride(-1) != 1:
        return rows_ref(x, w)
    out: torch.Tensor = ops.rows_f32(x, w)
    return out


def rows_operand(plain: torch.Tensor, packed: torch.Tensor) -> SmallRows | Packed:
    """``plain`` (``[out, in]``) with its packed twin as a batched step takes it: a :class:`SmallRows` when
    the kernels are loaded and ``plain`` is float32 with contiguous rows, else :class:`Packed`."""
    if plain.dtype == torch.float32 and plain.stride(-1) == 1 and kernel_ops() is not None:
        return SmallRows(plain, packed, MAX_ROWS)
    return Packed(packed)


def many_operand(weight_t: Matrix, packed: torch.Tensor | None) -> RowsOperand:
    """A held ``[in, out]`` matrix as several sequences' products
    (:func:`~rsmem.models.step.fused.matmul_rows`) take it: with its oneDNN ``packed`` twin
    (:func:`rows_operand`: the few-row kernel up to :data:`MAX_ROWS` rows when the kernels are loaded, the
    twin beyond), else ``[out, in]`` (a quantized matrix as it is)."""
    if packed is None or not isinstance(weight_t, torch.Tensor):
        return out_in(weight_t)
    return rows_operand(weight_t.t(), packed)


@overload
def one_operand(weight_t: torch.Tensor, packed: torch.Tensor | None) -> torch.Tensor | SmallRows: ...
@overload
def one_operand(weight_t: Matrix, packed: torch.Tensor | None) -> Matrix | SmallRows: ...
def one_operand(weight_t: Matrix, packed: torch.Tensor | None) -> Matrix | SmallRows:
    """A held ``[in, out]`` matrix as one sequence's products (:func:`~rsmem.models.step.fused.gemv`) take
    it: the few-row kernel's operand when the kernels are loaded (it streams the weights on rsmem's own
    workers, whose wait spins while the core is idle: ``kernels/csrc/pool.h``), else ``[out, in]`` (a
    reduction inductor fuses, or a quantized matrix's kernel)."""
    operand = many_operand(weight_t, packed)
    return operand if isinstance(operand, SmallRows) else out_in(weight_t)
