"""Mamba's and Mamba-2's decode step of one or many sequences as one C++ op, checked before use
(``kernels/csrc/mamba_step.cpp``, ``mamba2_step.cpp``).

The compiled step (:func:`~rsmem.models.step.fused.token_step` under inductor) streams the weights through
the same product kernels, but around them a token pays for the generated Python wrapper (~100 buffers
and calls), dynamo's guards on ~270 inputs and the mixer's kernel on one thread, together a large share of
a small model's token. ``rsmem_native::mamba2_step`` (``mamba_step``) is the whole token in
one call: the pre-norms, the products (the few-row kernel for float32 ``[out, in]`` rows,
``rsmem_native::qmatmul`` for blocks), the mixer with its state update shared between rsmem's product
workers, the residual, the final norm and the head. It takes up to :data:`MAX_ROWS` sequences at once
(each a row of the activations and of the states): a batched compiled step also wakes torch's OpenMP
threads for inductor's mixer kernels, which this op's own workers never do.

:class:`NativeStep` takes a model's matrices as they are (no copy); :meth:`NativeStep.__call__` has the
compiled step's arguments. Its first call runs the op and the eager twin (the compiled step's own function)
on copies of the states and compares them; where the op fails or differs, a warning says so and the
model keeps its compiled step (nothing was written).
"""

from __future__ import annotations

import operator
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from rsmem import settings
from rsmem.kernels.build import loaded_native_ops
from rsmem.models.step.fused import SmallRows
from rsmem.models.step.memo import same_objects
from rsmem.models.step.native_forms import (
    FLOAT_QTYPES,
    SLICED_F32,
    matrix_qtype,
    native_matrix,
    row_slices,
    taken_matrix,
)
from rsmem.models.step.operands import StepOperands

# The first call's check (one layer of each kind at a time): logits and states within this of the twin's,
# relative to their largest magnitude; a wrong layout or operand gives differences of order 1. With float
# matrices the op and the twin differ only in summation order; quantized matrices' int8 routes quantize the
# activations (llama.cpp's Q8_K), so a difference in a last bit can move a value to the next integer step.
# Both bounds sit far above the differences seen on the 130M random Mamba and Mamba-2 files.
CHECK_TOLERANCE = 1e-4
QUANTIZED_CHECK_TOLERANCE = 1e-2
# Sequences up to which the op runs (more take the compiled step). Float32 products go through the few-row
# kernel, from PACKED_FROM_ROWS rows through oneDNN's packed twins. Up to this many the op is ahead of
# the compiled step (bench/native_step.py compares them), most of all for Mamba-2, whose compiled mixer is
# most of a wide step.
MAX_ROWS = 128
# Rows from which a step takes float32 matrices as their oneDNN packed twins (fewer: the few-row kernel on
# the plain rows): the few-row kernel, streaming cold weights once, stays ahead up to 64 rows, the packed
# product's blocking beyond (at::mm on the plain matrix repacks the weights on every call: behind both).
PACKED_FROM_ROWS = 65
# ... and the head alone from this many: within the step, whose other products stay on rsmem's workers,
# waking oneDNN's threads for the head takes back part of what packing gains, which pays off from 64 rows
# and not below
PACKED_HEAD_FROM_ROWS = 64
# ... from this many rows (and up to MAX_ROWS), every float32 matrix and the head: within a step the
# slices are behind the few-row kernel at 8 rows, even at 16 and ahead from 32 (the matrices alone, outside
# a step, favour the slices earlier: only the step's own timing decides).
SLICED_FROM_ROWS = 32


def _getter(positions: list[int]) -> Callable[[Sequence[Any]], tuple[Any, ...]]:
    """The items of a sequence at ``positions``, as a tuple (``operator.itemgetter``, whose one-position form
    gives the item alone)."""
    if len(positions) == 1:
        at = positions[0]
        return lambda seq: (seq[at],)
    if not positions:
        return lambda seq: ()
    return operator.itemgetter(*positions)


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
    tensors as ``operands`` names them (its two states last: ``n_fields`` a layer, the matrices the op
    takes with a qtype each at positions ``matrices``); ``consts``: the op's arguments after the head's
    qtype; ``span``: the layers the first call's check runs together (2 where a layer differs from the
    first, as RWKV-7's value-residual mix); ``sliced``: the op takes ``slices`` and ``n_slices`` after
    ``consts`` (:data:`SLICED_F32`), and from :data:`SLICED_FROM_ROWS` rows gets every float32 matrix that
    way (the slices made at that first call, one a thread: a copy of those matrices).
    """

    def __init__(
        self,
        op: str,
        twin: Callable[..., torch.Tensor],
        operands: StepOperands,
        consts: tuple[Any, ...],
        span: int = 1,
        sliced: bool = False,
    ) -> None:
        self.op = op
        self.twin = twin
        self.n_fields = operands.n_fields
        self.matrices = operands.matrix_positions
        if operands.state_positions != (self.n_fields - 2, self.n_fields - 1):
            raise ValueError(f"{operands.name}: a layer's two states must end its operands")
        self.consts = consts
        self.span = span
        self.takes_slices = sliced  # the op's last two arguments (none for the other ops)
        self.sliced = sliced  # and from SLICED_FROM_ROWS rows the matrices as slices (off if its check fails)
        self.failed: BaseException | str | None = None
        self._checked = False
        self._sliced_checked = False
        self._has_twins = False  # any float32 matrix with a packed twin (set by the first check)
        # form (layers packed, head packed, sliced) -> (the head and layer weights it was made of, the op's
        # weight operands, slices)
        self._cache: dict[
            tuple[bool, bool, bool],
            tuple[tuple[Any, ...], list[torch.Tensor], list[int], torch.Tensor, int, list[torch.Tensor]],
        ] = {}
        self._picker_cache: dict[int, tuple[Callable[[Sequence[Any]], tuple[Any, ...]], ...]] = {}
        # id(plain matrix) -> (that matrix, its row slices), made at the first sliced call
        self._slices: dict[int, tuple[torch.Tensor, list[torch.Tensor]]] = {}
        self.n_slices = 0
        # the weights (head first) whose every matrix has a form the op takes: accepts' verdict, kept (the
        # objects themselves, so that their ids stay theirs) as the model's matrices do not change
        self._accepted: tuple[Any, ...] = ()
        self._accepted_flat: Sequence[Any] | None = None  # the last list accepts said yes to
        # the last call's flat list and form, and the op's operands made of them
        self._last: tuple[Sequence[Any], Any, tuple[bool, bool, bool], tuple[Any, ...]] | None = None

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
        if flat is self._accepted_flat and head is self._accepted[0]:
            return True  # the very list it accepted last (steady decode: StepMemo)
        n = self.n_fields
        pick_weights, pick_states = self._pickers(len(flat))
        weights = (head, *pick_weights(flat))
        if not same_objects(weights, self._accepted):
            if native_matrix(head) is None:
                return False
            for i in range(0, len(flat), n):
                if any(native_matrix(flat[i + m]) is None for m in self.matrices):
                    return False
            self._accepted = weights
        if not all(s.dtype == torch.float32 and s.is_contiguous() for s in pick_states(flat)):
            return False
        self._accepted_flat = flat
        return True

    def _pickers(self, size: int) -> tuple[Callable[[Sequence[Any]], tuple[Any, ...]], ...]:
        """For ``flat`` of ``size`` tensors: the getters of its weights (every layer's tensors but its two
        states) and of its states, each as a tuple in order (C-level: a step calls them with ~400 tensors)."""
        pickers = self._picker_cache.get(size)
        if pickers is None:
            n = self.n_fields
            weights = [i for i in range(size) if i % n < n - 2]
            states = [i for i in range(size) if i % n >= n - 2]
            pickers = self._picker_cache[size] = (_getter(weights), _getter(states))
        return pickers

    def _assemble(
        self,
        head: Any,
        flat: Sequence[Any],
        take: Callable[[Any], tuple[torch.Tensor, int]],
        take_head: Callable[[Any], tuple[torch.Tensor, int]],
    ) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int]:
        """The op's layer tensors, every matrix as ``take`` gives it with its qtype, and the head as
        ``take_head`` gives it."""
        tensors, qtypes = [], []
        for i, t in enumerate(flat):
            if i % self.n_fields in self.matrices:
                w, q = take(t)
                tensors.append(w)
                qtypes.append(q)
            else:
                tensors.append(t)
        head_w, head_q = take_head(head)
        return tensors, qtypes, head_w, head_q

    def _build(
        self, head: Any, flat: Sequence[Any], packed: bool = False, packed_head: bool | None = None
    ) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int]:
        """The op's layer tensors (matrices as :func:`native_matrix` gives them, ``packed`` or not) and
        qtypes, and the head (``packed_head`` or not; None: as the layers)."""
        head_packed = packed if packed_head is None else packed_head
        return self._assemble(
            head, flat, lambda m: taken_matrix(m, packed), lambda m: taken_matrix(m, head_packed)
        )

    def _build_sliced(
        self, head: Any, flat: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int, list[torch.Tensor]]:
        """:meth:`_build` with every float32 matrix that has a packed twin (a :class:`SmallRows`) as
        :data:`SLICED_F32`, and the op's ``slices`` (``n_slices`` a matrix, the head's last; placeholders for
        the others)."""
        if not self.n_slices:
            self.n_slices = max(1, torch.get_num_threads())
        n, blank = self.n_slices, torch.empty(0)
        slices: list[torch.Tensor] = []

        def take(matrix: Any) -> tuple[torch.Tensor, int]:
            if not isinstance(matrix, SmallRows):
                slices.extend([blank] * n)
                return taken_matrix(matrix)
            entry = self._slices.get(id(matrix.plain))
            if entry is None or entry[0] is not matrix.plain:
                entry = self._slices[id(matrix.plain)] = (matrix.plain, row_slices(matrix.plain, n))
            if len(entry[1]) != n:  # fewer rows than slices: the plain rows
                slices.extend([blank] * n)
                return matrix.plain, -1
            slices.extend(entry[1])
            return matrix.plain, SLICED_F32

        return (*self._assemble(head, flat, take, take), slices)

    def _operands(
        self, head: Any, flat: Sequence[Any], packed: bool, packed_head: bool, sliced: bool = False
    ) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int, list[torch.Tensor]]:
        """:meth:`_build` (:meth:`_build_sliced` when ``sliced``) and the op's slices, the weights' part kept
        between calls (the model's matrices do not change), the states this call's."""
        form = (packed, packed_head, sliced)
        last = self._last
        if last is not None and last[0] is flat and last[1] is head and last[2] == form:
            return last[3]  # the very list and head of the last call (steady decode), in the same form
        key = (head, *self._pickers(len(flat))[0](flat))
        cached = self._cache.get(form)
        if cached is None or not same_objects(cached[0], key):
            built = (
                self._build_sliced(head, flat)
                if sliced
                else (*self._build(head, flat, packed, packed_head), [])
            )
            cached = self._cache[form] = (key, *built)
        _, tensors, qtypes, head_w, head_q, slices = cached
        layers = list(tensors)
        for i in range(self.n_fields - 2, len(flat), self.n_fields):
            layers[i], layers[i + 1] = flat[i], flat[i + 1]
        operands = (layers, qtypes, head_w, head_q, slices)
        self._last = (flat, head, form, operands)
        return operands

    def _run(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, flat: Sequence[Any]
    ) -> torch.Tensor:
        rows = x.shape[0]  # the head as its packed twin (where it has one) from PACKED_HEAD_FROM_ROWS
        op = getattr(self.ops(), self.op)
        if self.sliced and rows >= SLICED_FROM_ROWS:
            layers, qtypes, head_w, head_q, slices = self._operands(head, flat, False, False, sliced=True)
            out: torch.Tensor = op(
                x, layers, qtypes, norm_f, head_w, head_q, *self.consts, slices, self.n_slices
            )
            return out
        layers, qtypes, head_w, head_q, _ = self._operands(
            head, flat, rows >= PACKED_FROM_ROWS, rows >= PACKED_HEAD_FROM_ROWS
        )
        out = op(x, layers, qtypes, norm_f, head_w, head_q, *self.consts, *self._no_slices())
        return out

    def _no_slices(self) -> tuple[Any, ...]:
        """The op's ``slices`` and ``n_slices`` when no matrix is sliced (nothing for ops without them)."""
        return ([], 0) if self.takes_slices else ()

    def _compare(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, layers: list[Any], form: str
    ) -> str | None:
        """Consecutive layers (then the final norm and the head) through the op (its matrices ``plain``,
        ``packed`` or ``sliced``: ``form``) and through the twin, on copies of the first sequence's states:
        None, or what differs beyond the bound (the twin is the one-sequence step's function; the op's rows
        are independent of each other)."""
        n = self.n_fields
        x = x[:1]
        mine, theirs = [], []
        for i, t in enumerate(layers):
            state = i % n >= n - 2
            mine.append(t[:1].clone() if state else t)
            theirs.append(t[:1].clone() if state else t)
        op = getattr(self.ops(), self.op)
        if form == "sliced":
            tensors, qtypes, head_w, head_q, slices = self._build_sliced(head, mine)
            got = op(x, tensors, qtypes, norm_f, head_w, head_q, *self.consts, slices, self.n_slices)
        else:
            tensors, qtypes, head_w, head_q = self._build(head, mine, form == "packed")
            got = op(x, tensors, qtypes, norm_f, head_w, head_q, *self.consts, *self._no_slices())
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
        shown = "" if form == "plain" else f" ({form} matrices)"
        return (
            f"its {what}{shown} differ from the compiled step's function by {worst:.2e} of their largest "
            f"magnitude (bound {tol:g})"
        )

    def _kinds(self, flat: Sequence[Any]) -> list[list[Any]]:
        """``span`` consecutive layers of each kind (the qtypes of their matrices), the first of each."""
        n, span = self.n_fields, min(self.span, len(flat) // self.n_fields)
        kinds: dict[tuple[int | None, ...], list[Any]] = {}
        for i in range(0, len(flat) - n * span + 1, n):
            layers = list(flat[i : i + n * span])
            kind = tuple(matrix_qtype(layers[j + m]) for j in range(0, len(layers), n) for m in self.matrices)
            kinds.setdefault(kind, layers)
        return list(kinds.values())

    def _first_difference(
        self,
        x: torch.Tensor,
        norm_f: torch.Tensor,
        head: Any,
        eps: float,
        flat: Sequence[Any],
        forms: list[str],
    ) -> BaseException | str | None:
        """:meth:`_compare` over every kind of layers and form: the first problem, or None."""
        try:
            for layers in self._kinds(flat):
                for form in forms:
                    problem = self._compare(x, norm_f, head, eps, layers, form)
                    if problem is not None:
                        return problem
        except Exception as exc:  # a layout or build this op does not take
            return exc
        return None

    def check(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, flat: Sequence[Any]
    ) -> bool:
        """Once: the op against the twin, ``span`` layers of each kind (the qtypes of their matrices) at a
        time, on copies of their states; False (and a warning) where it fails. A few layers at a time:
        through a random model's depth the int8 routes' rounding compounds (a random 130M Q8_0 Mamba's last
        states differed by 0.22 of their largest magnitude between the compiled step and its own function
        run eagerly). The sliced form (``sliced``) is checked at the first call of :data:`SLICED_FROM_ROWS`
        rows, which makes its slices; where it fails, a warning says so and the op keeps its other forms."""
        if not self._checked:
            self._checked = True
            forms = ["plain"]
            self._has_twins = any(isinstance(t, SmallRows) and t.packed.is_mkldnn for t in (head, *flat))
            if self._has_twins:
                forms.append("packed")  # many sequences take the packed twins: checked as well
            self.failed = self._first_difference(x, norm_f, head, eps, flat, forms)
            if self.failed is not None:
                warnings.warn(
                    f"rsmem: the C++ decode step {self.op} is not used: {self.failed}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if (
            self.failed is None
            and self.sliced
            and x.shape[0] >= SLICED_FROM_ROWS
            and not self._sliced_checked
        ):
            self._sliced_checked = True
            problem = (
                self._first_difference(x, norm_f, head, eps, flat, ["sliced"]) if self._has_twins else None
            )
            if problem is not None or not self._has_twins:
                self.sliced = False
            if problem is not None:
                warnings.warn(
                    f"rsmem: the C++ decode step {self.op} keeps its products off sliced matrices: {problem}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        return self.failed is None

    def __call__(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, *flat: Any
    ) -> torch.Tensor:
        """The logits ``[n_seqs, n_vocab]``; each layer's window and h updated in place."""
        return self.run(x, norm_f, head, eps, flat)

    def run(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, flat: Sequence[Any]
    ) -> torch.Tensor:
        """:meth:`__call__` with the layers' tensors as one sequence: a step that passes the same list
        again (:class:`~rsmem.models.step.memo.StepMemo`) reuses the op's operands made of it, so the list
        must not change once passed."""
        return self._run(x, norm_f, head, eps, flat)
