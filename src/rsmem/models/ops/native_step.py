"""Mamba's and Mamba-2's one-sequence decode step as one C++ op, checked before use
(``kernels/csrc/mamba_step.cpp``, ``mamba2_step.cpp``).

The compiled step (:func:`~rsmem.models.ops.fused.token_step` under inductor) streams the weights through
the same product kernels, but around them a token of the 130M Mamba-2 model paid ~2 ms in the generated
Python wrapper (~100 buffers and calls), ~0.5 ms in dynamo's guards on ~270 inputs and ~2.3 ms in the
mixer's kernel on one thread. ``rsmem_native::mamba2_step_one`` (``mamba_step_one``) is the whole token in
one call: the pre-norms, the products (the few-row kernel for float32 ``[out, in]`` rows,
``rsmem_native::qmatmul`` for blocks), the mixer with its state update shared between rsmem's product
workers, the residual, the final norm and the head.

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

# The first call's check: logits and states within this of the twin's (relative to the largest magnitude);
# a wrong layout or operand gives differences of order 1. With float matrices the op and the twin differ
# only in summation order (their products are the same kernel but dt_proj's and the mixer's): the random 130M
# Mamba's first token differed by 1.05e-4 of its largest logit. Quantized matrices' int8 routes quantize
# the activations (llama.cpp's Q8_K), so a difference in a last bit can move a value to the next integer
# step: a random 130M Q4_K_M Mamba-2's logits then differ by ~1e-2 after one token (the compiled step
# against the eager one too, a few tokens on).
CHECK_TOLERANCE = 1e-3
QUANTIZED_CHECK_TOLERANCE = 0.1
# qtypes whose products keep float32 activations: float32 rows (-1), F16, BF16
FLOAT_QTYPES = (-1, int(gguf.GGMLQuantizationType.F16), int(gguf.GGMLQuantizationType.BF16))


def native_matrix(matrix: Any) -> tuple[torch.Tensor, int] | None:
    """A one-sequence operand (:func:`~rsmem.models.ops.small_rows.one_operand`) as the op takes it:
    ``(float32 [out, in] with contiguous rows, -1)`` or ``(blocks, qtype)``; None for any other."""
    if isinstance(matrix, QuantMatrix):
        return matrix.blocks, matrix.qtype
    w = matrix.plain if isinstance(matrix, SmallRows) else matrix
    if isinstance(w, torch.Tensor) and w.dtype == torch.float32 and w.dim() == 2 and w.stride(1) == 1:
        return w, -1
    return None


def _close(a: torch.Tensor, b: torch.Tensor, tolerance: float) -> bool:
    scale = max(float(b.abs().max()), 1e-30) if b.numel() else 1.0
    return a.shape == b.shape and bool(((a - b).abs() <= tolerance * scale).all())


class NativeStep:
    """One sequence's decode step through the op ``rsmem_native.<op>``.

    ``twin``: the compiled step's function, ``(x, norm_f, head, eps, *flat)`` with ``flat`` each layer's
    ``n_fields`` tensors (window and h last); ``matrices``: the positions among them of the matrices the op
    takes with a qtype each; ``consts``: the op's arguments after the head's qtype.
    """

    def __init__(
        self,
        op: str,
        twin: Callable[..., torch.Tensor],
        n_fields: int,
        matrices: tuple[int, ...],
        consts: tuple[float | int, ...],
    ) -> None:
        self.op = op
        self.twin = twin
        self.n_fields = n_fields
        self.matrices = matrices
        self.consts = consts
        self.failed: BaseException | str | None = None
        self._checked = False
        self._cache: tuple[tuple[int, ...], list[torch.Tensor], list[int], torch.Tensor, int] | None = None

    def ops(self) -> Any:
        """The kernels when they are loaded in this process (never built for this: the compiled step and
        quantized or F16 matrices build them) and ``RSMEM_NATIVE_STEP`` is not 0, else None."""
        ops = loaded_native_ops() if settings.native_step_enabled() else None
        return ops if ops is not None and hasattr(ops, self.op) else None

    def usable(self) -> bool:
        """Whether the op runs here (:meth:`ops`) and has not failed its check."""
        return self.failed is None and self.ops() is not None

    def accepts(self, head: Any, flat: Sequence[Any]) -> bool:
        """Whether the op runs here (:meth:`ops`), every matrix has a form it takes and every state is a
        contiguous float32 tensor."""
        if self.failed is not None or self.ops() is None or native_matrix(head) is None:
            return False
        for i in range(0, len(flat), self.n_fields):
            layer = flat[i : i + self.n_fields]
            if any(native_matrix(layer[m]) is None for m in self.matrices):
                return False
            if any(s.dtype != torch.float32 or not s.is_contiguous() for s in layer[-2:]):
                return False
        return True

    def _operands(
        self, head: Any, flat: Sequence[Any]
    ) -> tuple[list[torch.Tensor], list[int], torch.Tensor, int]:
        """The op's layer tensors and qtypes; the weights' part is kept (the model's matrices do not change),
        the states are this call's."""
        key = tuple(id(t) for i, t in enumerate(flat) if i % self.n_fields < self.n_fields - 2)
        if self._cache is None or self._cache[0] != key:
            tensors, qtypes = [], []
            for i, t in enumerate(flat):
                k = i % self.n_fields
                if k in self.matrices:
                    w, q = native_matrix(t)  # type: ignore[misc]
                    tensors.append(w)
                    qtypes.append(q)
                else:
                    tensors.append(t)
            head_w, head_q = native_matrix(head)  # type: ignore[misc]
            self._cache = (key, tensors, qtypes, head_w, head_q)
        _, tensors, qtypes, head_w, head_q = self._cache
        layers = list(tensors)
        for i in range(self.n_fields - 2, len(flat), self.n_fields):
            layers[i], layers[i + 1] = flat[i], flat[i + 1]
        return layers, qtypes, head_w, head_q

    def _run(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, flat: Sequence[Any]
    ) -> torch.Tensor:
        layers, qtypes, head_w, head_q = self._operands(head, flat)
        return getattr(self.ops(), self.op)(x, layers, qtypes, norm_f, head_w, head_q, *self.consts)

    def check(
        self, x: torch.Tensor, norm_f: torch.Tensor, head: Any, eps: float, flat: Sequence[Any]
    ) -> bool:
        """Once: the op against the twin on copies of the states; False (and a warning) where it fails."""
        if not self._checked:
            self._checked = True
            states = {i for i in range(len(flat)) if i % self.n_fields >= self.n_fields - 2}
            mine = [t.clone() if i in states else t for i, t in enumerate(flat)]
            theirs = [t.clone() if i in states else t for i, t in enumerate(flat)]
            try:
                got = self._run(x, norm_f, head, eps, mine)
                want = self.twin(x, norm_f, head, eps, *theirs)
                _, qtypes, _, head_q = self._operands(head, flat)
                quantized = any(q not in FLOAT_QTYPES for q in (*qtypes, head_q))
                tol = QUANTIZED_CHECK_TOLERANCE if quantized else CHECK_TOLERANCE
                if not _close(got, want, tol) or not all(
                    _close(mine[i], theirs[i], tol) for i in sorted(states)
                ):
                    self.failed = "its logits or states differ from the compiled step's function"
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
        """The logits ``[1, n_vocab]``; each layer's window and h updated in place."""
        return self._run(x, norm_f, head, eps, flat)
