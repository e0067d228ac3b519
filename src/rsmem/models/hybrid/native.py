"""A hybrid model's decode step (one token of each of up to :data:`MAX_ROWS` sequences) as one C++ op,
``rsmem_native::hybrid_step`` (``kernels/csrc/hybrid_step.cpp``), checked before use.

The compiled chains (:mod:`rsmem.models.hybrid.chains`) stream the same products, but around them a token
pays a large share of its time for a compiled call per stretch between attention layers (dynamo's
guards, the wrappers), and between them the KV cache's store and attention in Python (SDPA's parallel region
for one query wakes torch's sleeping OpenMP thread). The op runs the whole token: a model describes its step
once as a list of :class:`NativeBlock` (residual blocks of the kinds the op knows: LFM2's short convolution,
SwiGLU, Nemotron-H's ReLU² MLP, attention, Mamba-2's layer), and each step fills in the states and the KV
cache's rows and cells (:meth:`~rsmem.memory.kv_attention.KVCacheContext.decode_cells`).

The first call of each form of the matrices (float32 ones plain, or from PACKED_FROM_ROWS sequences their
oneDNN packed twins) runs the op on copies (the states, and the KV rows it reads or writes gathered into a
small table) and then the compiled chains for real, and compares logits, states and the keys and values
written; where the op fails or differs, a warning says so and the model keeps its chains.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rsmem import settings
from rsmem.batch.batch import UBatch
from rsmem.kernels.build import loaded_native_ops
from rsmem.memory.kv_attention import DecodeCells
from rsmem.models.hybrid.layers import HybridStates
from rsmem.models.ops.common import output_rows
from rsmem.models.step.native import (
    CHECK_TOLERANCE,
    MAX_ROWS,
    PACKED_FROM_ROWS,
    difference,
)
from rsmem.models.step.native_forms import native_matrix
from rsmem.models.step.operands import ATTENTION_BLOCK, CONV_BLOCK, MLP_BLOCK
from rsmem.models.step.operands import MAMBA2 as MAMBA2_LAYER

CONV, SWIGLU, RELU2, ATTENTION, MAMBA2 = range(5)  # the op's block kinds (hybrid_step.cpp's Kind)
# each kind's tensors in the op's order
OPERANDS = {
    CONV: CONV_BLOCK,
    SWIGLU: MLP_BLOCK,
    RELU2: MLP_BLOCK,
    ATTENTION: ATTENTION_BLOCK,
    MAMBA2: MAMBA2_LAYER,
}
N_TENSORS = {kind: ops.n_fields for kind, ops in OPERANDS.items()}
MATRICES = {kind: ops.matrix_positions for kind, ops in OPERANDS.items()}
# a block's tensors filled each step: its layer's states (window; window and h) or KV rows (keys, values)
FILLED = {kind: ops.state_positions for kind, ops in OPERANDS.items()}
NONE = torch.empty(0)  # an absent q/k norm or RoPE table


@dataclass(frozen=True, slots=True)
class NativeBlock:
    """One residual block of the step: ``kind``, the layer ``il`` whose states or KV rows fill its
    :data:`FILLED` positions, its other tensors in the op's order (None at the filled positions; matrices
    as one-sequence operands, :func:`~rsmem.models.step.native.native_matrix`), and for attention the
    head counts and the scale."""

    kind: int
    il: int
    tensors: tuple[Any, ...]
    heads: tuple[int, int] = (0, 0)
    scale: float = 0.0


class HybridNativeStep:
    """The op over a model's blocks, the final norm ``norm_f`` and ``head``; ``n_group`` and ``eps`` as the
    model's."""

    def __init__(
        self, blocks: list[NativeBlock], norm_f: torch.Tensor, head: Any, n_group: int, eps: float
    ) -> None:
        self.failed: BaseException | str | None = None
        self.checked: set[bool] = set()  # the forms checked: packed (True) or plain (False)
        self.attention_layers = tuple(b.il for b in blocks if b.kind == ATTENTION)
        self._kinds = [b.kind for b in blocks]
        self._heads = [h for b in blocks if b.kind == ATTENTION for h in b.heads]
        self._scales = [b.scale for b in blocks if b.kind == ATTENTION]
        self._consts = (n_group, eps)
        self._norm_f = norm_f
        # each form's tensors, matrices' qtypes, head and its qtype; the filled positions are the same in both
        plain, self._slots = self._operands(blocks, head, False)
        self._forms = {False: plain, True: self._operands(blocks, head, True)[0]}

    def _operands(
        self, blocks: list[NativeBlock], head: Any, packed: bool
    ) -> tuple[tuple[list[torch.Tensor], list[int], torch.Tensor, int], list[tuple[int, int, int]]]:
        """The op's tensors (matrices ``packed`` or not; placeholders where a step fills in), their qtypes,
        the head and its qtype; and the slots each step fills: (position, layer, index in its fill)."""
        flat: list[torch.Tensor] = []
        qtypes: list[int] = []
        slots: list[tuple[int, int, int]] = []
        found = native_matrix(head, packed)
        for b in blocks:
            if len(b.tensors) != N_TENSORS[b.kind]:
                n = N_TENSORS[b.kind]
                raise ValueError(f"block kind {b.kind} takes {n} tensors, got {len(b.tensors)}")
            for i, t in enumerate(b.tensors):
                if i in FILLED[b.kind]:
                    slots.append((len(flat), b.il, FILLED[b.kind].index(i)))
                    flat.append(NONE)
                elif i in MATRICES[b.kind]:
                    m = native_matrix(t, packed)
                    if m is None:
                        found = None
                        break
                    flat.append(m[0])
                    qtypes.append(m[1])
                else:
                    flat.append(NONE if t is None else t)
        if found is None:
            self.failed = "a matrix has no form the op takes"
            return (flat, qtypes, NONE, -1), slots
        return (flat, qtypes, found[0], found[1]), slots

    def usable(self, n_seqs: int) -> bool:
        """Whether the op runs here for ``n_seqs`` sequences: the kernels are loaded, ``RSMEM_NATIVE_STEP``
        is not 0, and the op has not failed its check."""
        if n_seqs > MAX_ROWS or self.failed is not None or not settings.native_step_enabled():
            return False
        ops = loaded_native_ops()
        return ops is not None and hasattr(ops, "hybrid_step")

    def __call__(
        self,
        x: torch.Tensor,
        fills: Mapping[int, tuple[torch.Tensor, ...]],
        cells: DecodeCells,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> torch.Tensor:
        """The logits ``[n_seqs, n_vocab]`` of one token a sequence (``x`` their embeddings); ``fills``: each
        layer's states (updated in place) or KV rows (the tokens' keys and values written); ``cells`` as
        ``decode_cells`` gives them; ``rope``: cos and sin ``[n_seqs, ..., n_rot / 2]``."""
        n = x.shape[0]
        tensors, qtypes, head, head_q = self._forms[n >= PACKED_FROM_ROWS]
        flat = list(tensors)
        for at, il, k in self._slots:
            flat[at] = fills[il][k]
        store, index, valid = cells
        cos, sin = (NONE, NONE) if rope is None else (rope[0].reshape(n, -1), rope[1].reshape(n, -1))
        ops = loaded_native_ops()
        assert ops is not None
        return ops.hybrid_step(
            x, self._kinds, flat, qtypes, self._heads, self._scales, store, index, valid, cos, sin,
            self._norm_f, head, head_q, *self._consts,
        )  # fmt: skip

    def decode(
        self,
        x: torch.Tensor,
        fills: Mapping[int, tuple[torch.Tensor, ...]],
        cells: DecodeCells,
        rope: tuple[torch.Tensor, torch.Tensor] | None,
        rows: list[int],
        twin: Callable[[], torch.Tensor],
    ) -> torch.Tensor:
        """The logits of the output ``rows``: through the op, or (the first call of a form of the matrices)
        through ``twin`` (the compiled chains, run for real) after the op ran on copies and was compared
        with it."""
        form = x.shape[0] >= PACKED_FROM_ROWS
        if form in self.checked:
            return output_rows(self(x, fills, cells, rope), rows)
        self.checked.add(form)
        try:
            copies, cells_copy = self._copies(fills, cells)
            got = output_rows(self(x, copies, cells_copy, rope), rows)
        except Exception as exc:  # a layout or build the op does not take: the chains instead
            self.failed = exc
            got = None
        want = twin()
        if got is not None:
            self.failed = self._compare(got, want, copies, fills, cells_copy[0], cells[0])
        if self.failed is not None:
            warnings.warn(
                f"rsmem: the C++ hybrid decode step is not used: {self.failed}", RuntimeWarning, stacklevel=3
            )
        return want

    def _copies(
        self, fills: Mapping[int, tuple[torch.Tensor, ...]], cells: DecodeCells
    ) -> tuple[dict[int, tuple[torch.Tensor, ...]], DecodeCells]:
        """Copies of the states, and of the KV rows the step reads or writes gathered into a small table
        (the cells renumbered to it)."""
        store, index, valid = cells
        used = torch.unique(torch.cat([store, index[valid]]))  # sorted
        cells_copy = (
            torch.searchsorted(used, store),
            torch.where(valid, torch.searchsorted(used, index), 0),
            valid,
        )
        copies = {
            il: tuple(t[used].clone() if il in self.attention_layers else t.clone() for t in ts)
            for il, ts in fills.items()
        }
        return copies, cells_copy

    def _compare(
        self,
        got: torch.Tensor,
        want: torch.Tensor,
        copies: Mapping[int, tuple[torch.Tensor, ...]],
        fills: Mapping[int, tuple[torch.Tensor, ...]],
        store_copy: torch.Tensor,
        store: torch.Tensor,
    ) -> str | None:
        diffs = [("logits", difference(got, want))]
        for il, ts in fills.items():
            for mine, theirs in zip(copies[il], ts, strict=True):
                if il in self.attention_layers:  # the keys and values written
                    diffs.append((f"layer {il}'s KV rows", difference(mine[store_copy], theirs[store])))
                else:
                    diffs.append((f"layer {il}'s states", difference(mine, theirs)))
        what, worst = max(diffs, key=lambda item: item[1])
        if worst <= CHECK_TOLERANCE:
            return None
        return f"its {what} differ from the compiled chains' by {worst:.2e} of their largest magnitude"


def decode(
    step: HybridNativeStep | None,
    x: torch.Tensor,
    ubatch: UBatch,
    states: HybridStates,
    fills: Mapping[int, tuple[torch.Tensor, ...]],
    rope: tuple[torch.Tensor, torch.Tensor] | None,
    twin: Callable[[], torch.Tensor],
) -> torch.Tensor:
    """The logits of a decode step of ``ubatch``: through ``step`` where it is usable and the memory gives
    the KV cells (:meth:`HybridNativeStep.decode`), else through ``twin`` (the compiled chains)."""
    if step is not None and step.usable(x.shape[0]):
        cells = states.decode_cells(ubatch)
        if cells is not None:
            kv = {il: states.layer_rows(il) for il in step.attention_layers}
            return step.decode(x, {**fills, **kv}, cells, rope, ubatch.output_rows(), twin)
    return twin()
