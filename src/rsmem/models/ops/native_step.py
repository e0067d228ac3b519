"""Mamba's and Mamba-2's decode step of one or many sequences as one C++ op, checked before use
(``kernels/csrc/mamba_step.cpp``, ``mamba2_step.cpp``).

The compiled step (:func:`~rsmem.models.ops.fused.token_step` under inductor) streams the weights through
the same product kernels, but around them a token of the 130M Mamba-2 model paid ~2 ms in the generated
Python wrapper (~100 buffers and calls), ~0.5 ms in dynamo's guards on ~270 inputs and ~2.3 ms in the
mixer's kernel on one thread. ``rsmem_native::mamba2_step`` (``mamba_step``) is the whole token in
one call: the pre-norms, the products (the few-row kernel for float32 ``[out, in]`` rows,
``rsmem_native::qmatmul`` for blocks), the mixer with its state update shared between rsmem's product
workers, the residual, the final norm and the head. It takes up to :data:`MAX_ROWS` sequences at once
(each a row of the activations and of the states): at 8 sequences the compiled step of the 130M Mamba
Q4_K_M spent ~17% of its time waking torch's OpenMP threads for inductor's mixer kernels.

:class:`NativeStep` takes a model's matrices as they are (no copy); :meth:`NativeStep.__call__` has the
compiled step's arguments. Its first call runs the op and the eager twin (the compiled step's own function)
on copies of the states and compares them; where the op fails or differs, a warning says so and the
model keeps its compiled step (nothing was written).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any

import gguf
import torch

from rsmem import settings
from rsmem.kernels.build import loaded_native_ops
from rsmem.models.ops.fused import SmallRows
from rsmem.models.ops.quantized import QuantMatrix

# The first call's check (one layer of each kind at a time): logits and states within this of the twin's,
# relative to their largest magnitude; a wrong layout or operand gives differences of order 1. With float
# matrices the op and the twin differ only in summation order; quantized matrices' int8 routes quantize the
# activations (llama.cpp's Q8_K), so a difference in a last bit can move a value to the next integer step.
# The 130M random Mamba and Mamba-2 files, f32, Q8_0 and Q4_K_M: at most 1.5e-6.
CHECK_TOLERANCE = 1e-4
QUANTIZED_CHECK_TOLERANCE = 1e-2
# Sequences up to which the op runs (more take the compiled step). Float32 products go through the few-row
# kernel, from PACKED_FROM_ROWS rows through oneDNN's packed twins (at::mm before stop 21).
# bench/native_step.py, 3 rounds, compiled / C++ ms a step (at::mm then): Mamba-2 130M f32 1.28 at 64
# sequences, 1.35 at 128, Q4_K_M 1.46 at 64; Mamba f32 1.01 at 64 and 0.99 at 128 (its compiled mixer was
# already cheap; Mamba-2's is most of a wide step).
MAX_ROWS = 128
# qtype of a float32 matrix given as its oneDNN packed twin (csrc/step_common.h's kPackedF32)
PACKED_F32 = -2
# qtypes whose products keep float32 activations: float32 rows (-1), packed float32, F16, BF16
FLOAT_QTYPES = (-1, PACKED_F32, int(gguf.GGMLQuantizationType.F16), int(gguf.GGMLQuantizationType.BF16))
# Rows from which a step takes float32 matrices as their oneDNN packed twins (fewer: the few-row kernel on
# the plain rows). The 130M RWKV-7's 73 matrices, 2 threads, weights cold as in a step, 5 interleaved
# rounds, few-row kernel / packed time: 0.78 at 24 rows, 0.82 at 32, 0.91 at 48, 0.98 at 64, 1.04 at 96
# (at::mm on the plain matrix, which repacked the weights on every call, was slower than both).
PACKED_FROM_ROWS = 65
# ... and the head alone from this many (a [65536, 768] head by itself at 64 rows: 26.8 ms packed, 32.2
# the few-row kernel; within the step, whose other products stay on rsmem's workers, oneDNN's threads
# waking for it keep less: RWKV-7 step at 64 rows 0.980 and 0.986 of the time with the kernel's head (20
# and 40 interleaved rounds), RWKV-6 0.980; at 48 rows 1.006, at 32 1.009)
PACKED_HEAD_FROM_ROWS = 64


def native_matrix(matrix: Any, packed: bool = False) -> tuple[torch.Tensor, int] | None:
    """A one-sequence operand (:func:`~rsmem.models.ops.small_rows.one_operand`) as the op takes it:
    ``(float32 [out, in] with contiguous rows, -1)`` or ``(blocks, qtype)``; with ``packed``, a matrix with
    a oneDNN twin as ``(twin, PACKED_F32)``; None for any other."""
    if isinstance(matrix, QuantMatrix):
        return matrix.blocks, matrix.qtype
    if packed and isinstance(matrix, SmallRows):
        return matrix.packed, PACKED_F32
    w = matrix.plain if isinstance(matrix, SmallRows) else matrix
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.stride(1) == 1:
        return w, -1
    return None


def _taken(matrix: Any, packed: bool = False) -> tuple[torch.Tensor, int]:
    """:func:`native_matrix` of a matrix the op must take (:meth:`NativeStep.accepts` said so)."""
    found = native_matrix(matrix, packed)
    if found is None:
        raise ValueError(f"the C++ step takes no {type(matrix).__name__} of this layout as a matrix")
    return found


def _qtype(matrix: Any) -> int | None:
    found = native_matrix(matrix)
    return None if found is None else found[1]


def difference(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest ``|a - b|`` relative to ``b``'s largest magnitude (inf for other shapes or non-finite
    values)."""
    if a.shape != b.shape:
        return float("inf")
    if b.numel() == 0:
        return 0.0
    diff = float((a - b).abs().max()) / max(float(b.abs().max()), 1e-30)
    return diff if diff == diff else float("inf")  # NaN: inf


class NativeStep:
    """The decode step of up to :data:`MAX_ROWS` sequences through the op ``rsmem_native.<op>``.

    ``twin``: the compiled step's function, ``(x, norm_f, head, eps, *flat)`` with ``flat`` each layer's
    ``n_fields`` tensors (its two states last); ``matrices``: the positions among them of the matrices the
    op takes with a qtype each; ``consts``: the op's arguments after the head's qtype; ``span``: the layers
    the first call's check runs together (2 where a layer differs from the first, as RWKV-7's value-residual
    mix).
    """

    def __init__(
        self,
        op: str,
        twin: Callable[..., torch.Tensor],
        n_fields: int,
        matrices: tuple[int, ...],
        consts: tuple[Any, ...],
        span: int = 1,
    ) -> None:
        self.op = op
        self.twin = twin
        self.n_fields = n_fields
        self.matrices = matrices
        self.consts = consts
        self.span = span
        self.failed: BaseException | str | None = None
        self._checked = False
        # (layers packed, head packed) -> (ids of the weights, the op's weight operands), one entry a form
        self._cache: dict[
            tuple[bool, bool], tuple[tuple[int, ...], list[torch.Tensor], list[int], torch.Tensor, int]
        ] = {}
        # the weights (head first) whose every matrix has a form the op takes: accepts' verdict, kept (the
        # objects themselves, so that their ids stay theirs) as the model's matrices do not change
        self._accepted: tuple[Any, ...] = ()

    def ops(self) -> Any:
        """The kernels when they are loaded in this process (never built for this: the compiled step and
        quantized or F16 matrices build them) and ``RSMEM_NATIVE_STEP`` is not 0, else None."""
        ops = loaded_native_ops() if settings.native_step_enabled() else None
        return ops if ops is not None and hasattr(ops, self.op) else None

    def usable(self, n_seqs: int = 1) -> bool:
        """Whether the op runs here (:meth:`ops`) for ``n_seqs`` sequences and has not failed its check."""
        return n_seqs <= MAX_ROWS and self.failed is None and self.ops() is not None

    def accepts(self, head: Any, flat: Sequence[Any]) -> bool:
        """Whether the op runs here (:meth:`ops`), every matrix has a form it takes and every state is a
        contiguous float32 tensor."""
        if self.failed is not None or self.ops() is None:
            return False
        n = self.n_fields
        weights = (head, *(t for i, t in enumerate(flat) if i % n < n - 2))
        if len(weights) != len(self._accepted) or any(a is not b for a, b in zip(weights, self._accepted)):
            if native_matrix(head) is None:
                return False
            for i in range(0, len(flat), n):
                if any(native_matrix(flat[i + m]) is None for m in self.matrices):
                    return False
            self._accepted = weights
        states = (s for i, s in enumerate(flat) if i % n >= n - 2)
        return all(s.dtype == torch.float32 and s.is_contiguous() for s in states)

    def _build(
        self, head: Any, flat: Sequence[Any], packed: bool = False, packed_head: bool | None = None
    ) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int]:
        """The op's layer tensors (matrices as :func:`native_matrix` gives them, ``packed`` or not) and
        qtypes, and the head (``packed_head`` or not; None: as the layers)."""
        tensors, qtypes = [], []
        for i, t in enumerate(flat):
            if i % self.n_fields in self.matrices:
                w, q = _taken(t, packed)
                tensors.append(w)
                qtypes.append(q)
            else:
                tensors.append(t)
        head_w, head_q = _taken(head, packed if packed_head is None else packed_head)
        return tensors, qtypes, head_w, head_q

    def _operands(
        self, head: Any, flat: Sequence[Any], packed: bool, packed_head: bool
    ) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int]:
        """:meth:`_build`, the weights' part kept between calls (the model's matrices do not change), the
        states this call's."""
        key = tuple(id(t) for i, t in enumerate(flat) if i % self.n_fields < self.n_fields - 2)
        cached = self._cache.get((packed, packed_head))
        if cached is None or cached[0] != key:
            cached = self._cache[packed, packed_head] = (key, *self._build(head, flat, packed, packed_head))
        _, tensors, qtypes, head_w, head_q = cached
        layers = list(tensors)
        for i in range(self.n_fields - 2, len(flat), self.n_fields):
            layers[i], layers[i + 1] = flat[i], flat[i + 1]
        return layers, qtypes, head_w, head_q

    def _run(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, flat: Sequence[Any]
    ) -> torch.Tensor:
        rows = x.shape[0]  # the head as its packed twin (where it has one) from PACKED_HEAD_FROM_ROWS
        layers, qtypes, head_w, head_q = self._operands(
            head, flat, rows >= PACKED_FROM_ROWS, rows >= PACKED_HEAD_FROM_ROWS
        )
        return getattr(self.ops(), self.op)(x, layers, qtypes, norm_f, head_w, head_q, *self.consts)

    def _compare(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, layers: list[Any], packed: bool
    ) -> str | None:
        """Consecutive layers (then the final norm and the head) through the op (its matrices ``packed`` or
        not) and through the twin, on copies of the first sequence's states: None, or what differs beyond
        the bound (the twin is the one-sequence step's function; the op's rows are independent of each
        other)."""
        n = self.n_fields
        x = x[:1]
        mine, theirs = [], []
        for i, t in enumerate(layers):
            state = i % n >= n - 2
            mine.append(t[:1].clone() if state else t)
            theirs.append(t[:1].clone() if state else t)
        tensors, qtypes, head_w, head_q = self._build(head, mine, packed)
        got = getattr(self.ops(), self.op)(x, tensors, qtypes, norm_f, head_w, head_q, *self.consts)
        want = self.twin(x, norm_f, head, eps, *theirs)
        quantized = any(q not in FLOAT_QTYPES for q in (*qtypes, head_q))
        tol = QUANTIZED_CHECK_TOLERANCE if quantized else CHECK_TOLERANCE
        diffs = [("logits", difference(got, want))]
        for i in range(0, len(layers), n):
            for name, k in (("first state", i + n - 2), ("second state", i + n - 1)):
                diffs.append((name, difference(mine[k], theirs[k])))
        what, worst = max(diffs, key=lambda item: item[1])
        if worst <= tol:
            return None
        form = " (packed matrices)" if packed else ""
        return (
            f"its {what}{form} differ from the compiled step's function by {worst:.2e} of their largest "
            f"magnitude (bound {tol:g})"
        )

    def check(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, flat: Sequence[Any]
    ) -> bool:
        """Once: the op against the twin, ``span`` layers of each kind (the qtypes of their matrices) at a
        time, on copies of their states; False (and a warning) where it fails. A few layers at a time:
        through a random model's depth the int8 routes' rounding compounds (a random 130M Q8_0 Mamba's last
        states differed by 0.22 of their largest magnitude between the compiled step and its own function
        run eagerly)."""
        if not self._checked:
            self._checked = True
            n, span = self.n_fields, min(self.span, len(flat) // self.n_fields)
            kinds: dict[tuple[int | None, ...], list[Any]] = {}
            for i in range(0, len(flat) - n * span + 1, n):
                layers = list(flat[i : i + n * span])
                kind = tuple(_qtype(layers[j + m]) for j in range(0, len(layers), n) for m in self.matrices)
                kinds.setdefault(kind, layers)
            forms = [False]
            if isinstance(head, SmallRows) or any(isinstance(t, SmallRows) for t in flat):
                forms.append(True)  # many sequences take the packed twins: checked as well
            try:
                for layer, packed in ((layer, packed) for layer in kinds.values() for packed in forms):
                    self.failed = self._compare(x, norm_f, head, eps, layer, packed)
                    if self.failed is not None:
                        break
            except Exception as exc:  # a layout or build this op does not take: the compiled step instead
                self.failed = exc
            if self.failed is not None:
                warnings.warn(
                    f"rsmem: the C++ decode step {self.op} is not used: {self.failed}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return self.failed is None

    def __call__(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, *flat: Any
    ) -> torch.Tensor:
        """The logits ``[n_seqs, n_vocab]``; each layer's window and h updated in place."""
        return self._run(x, norm_f, head, eps, flat)
