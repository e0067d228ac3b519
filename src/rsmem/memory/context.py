"""The memory context: the plan for one batch (llama.cpp's ``llama_memory_recurrent_context``).

``init_batch`` builds it after a successful dry run; the caller then loops ``apply()`` -> model forward
-> ``next()``. It is also what a model forward receives: it exposes the placement of the current
micro-batch (``head``, ``n_rs``, ``rs_z``, ``s_copy``) and gathers and scatters the state rows. With a
rollback history, ``apply`` and ``next`` also tell it what each micro-batch did.
"""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import torch

from rsmem.batch.batch import UBatch

if TYPE_CHECKING:
    from rsmem.memory.recurrent import RecurrentMemory

NO_ROWS = torch.empty(0, dtype=torch.long)  # no rows to move (only read, never written)


class RowViews:
    """Views of rows ``[head, head + n)`` of every layer's state tensors, made once for a placement:
    step after step of steady decode, ``read_states`` hands out the very same view objects, so a model can
    keep what it built from them (:class:`~rsmem.models.step.memo.StepMemo`) and rebuild nothing.
    """

    def __init__(self, r_l: list[torch.Tensor | None], s_l: list[torch.Tensor | None]) -> None:
        self._r_l, self._s_l = r_l, s_l
        self._key: tuple[int, int] | None = None
        self._views: list[tuple[torch.Tensor, torch.Tensor] | None] = []

    def layer(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``il``'s whole ``(r, s)`` tensors; ValueError for a layer without states."""
        r, s = self._r_l[il], self._s_l[il]
        if r is None or s is None:
            raise ValueError(f"layer {il} has no recurrent state in this memory")
        return r, s

    def rows(self, il: int, head: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``il``'s ``(r, s)`` rows ``[head, head + n)``; ValueError for a layer without states."""
        key = (head, n)
        if key != self._key:
            self._key, self._views = key, [None] * len(self._r_l)
        views = self._views[il]
        if views is None:
            r, s = self.layer(il)
            views = self._views[il] = (r[head : head + n], s[head : head + n])
        return views


class MemoryStatus(enum.Enum):
    SUCCESS = 0
    NO_UPDATE = 1
    FAILED_PREPARE = 2
    FAILED_COMPUTE = 3


class RecurrentMemoryContext:
    """Micro-batches planned for the memory, applied one at a time."""

    def __init__(
        self,
        memory: RecurrentMemory,
        ubatches: list[UBatch],
        status: MemoryStatus,
        *,
        is_full: bool = False,
    ) -> None:
        self.memory = memory
        self.ubatches = ubatches
        self.status = status
        self.is_full = is_full
        self._i = 0
        self._applied = -1  # the micro-batch apply() placed last
        self._final_pos: dict[int, int] | None = None  # each sequence's last position in the batch
        self._copy_index: torch.Tensor | None = None
        self._src0: list[int] | None = None  # s_copy(i) of every cell, once _stage_moves has run
        self._moved_dst = self._moved_src = NO_ROWS  # rows to move, and from where
        self._zero_needed = False  # some cell reads the zero row rs_z
        self._staged: set[int] = set()  # layers whose staged moves the current micro-batch has done

    # ------------------------------------------------------------ the plan

    def next(self) -> bool:
        """The current micro-batch was computed: record it in the rollback history (if any), then move
        to the next one; False when there is none left."""
        rollback = self.memory.rollback
        if rollback is not None and self._applied == self._i < len(self.ubatches):
            rollback.after_ubatch(self.memory, self.ubatches[self._i], self.final_positions())
        self._i += 1
        self._copy_index = None
        self._src0 = None
        self._staged.clear()
        return self._i < len(self.ubatches)

    def apply(self) -> bool:
        """Place the current micro-batch in the memory (``find_slot``); its dry run already succeeded."""
        if self.status in (MemoryStatus.FAILED_PREPARE, MemoryStatus.FAILED_COMPUTE):
            raise RuntimeError(f"cannot apply a memory context with status {self.status.name}")
        if not self.ubatches:  # an update (NO_UPDATE) or a full context: nothing to place
            return True
        self._copy_index = None
        self._src0 = None
        self._staged.clear()
        if self.memory.rollback is not None:
            self.memory.rollback.before_ubatch(self.memory, self.ubatches[self._i])
        if not self.memory.find_slot(self.ubatches[self._i]):
            raise RuntimeError("find_slot failed after a successful prepare (bookkeeping bug)")
        self._applied = self._i
        return True

    @property
    def ubatch(self) -> UBatch:
        return self.ubatches[self._i]

    def final_positions(self) -> dict[int, int]:
        """Each sequence's last position in the whole batch (the first id of each sequence set)."""
        if self._final_pos is None:
            self._final_pos = {
                ub.seq_set(s)[0]: ub.last_pos(s) for ub in self.ubatches for s in range(ub.n_seqs)
            }
        return self._final_pos

    # ---------------------------------------------------- placement queries

    @property
    def head(self) -> int:
        return 0 if self.is_full else self.memory.head

    @property
    def n_rs(self) -> int:
        return self.memory.size if self.is_full else self.memory.n

    @property
    def rs_z(self) -> int:
        return 0 if self.is_full else self.memory.rs_z

    @property
    def size(self) -> int:
        return self.memory.size

    def s_copy(self, i: int) -> int:
        """Row that cell ``head + i`` reads its input state from."""
        return self.memory.cells.src0[self.head + i]

    def copy_index(self) -> torch.Tensor:
        """``s_copy(i)`` for every ``i < n_rs``, as an index tensor (built once per micro-batch)."""
        if self._copy_index is None:
            self._copy_index = torch.tensor(self._stage_moves(), dtype=torch.long, device=self.memory.device)
        return self._copy_index

    def _stage_moves(self) -> list[int]:
        """``s_copy(i)`` for every ``i < n_rs``; once per micro-batch, the rows ``read_states`` moves (each
        cell whose source row is not its own) and whether a cell reads the zero row, as well (no tensor when
        nothing moves: steady decode)."""
        if self._src0 is not None:
            return self._src0
        src0 = self._src0 = [self.s_copy(i) for i in range(self.n_rs)]
        moved = [i for i, src in enumerate(src0) if src != self.head + i]
        self._zero_needed = self.rs_z >= 0 and self.rs_z in src0
        if moved:
            device = self.memory.device
            self._moved_dst = torch.tensor([self.head + i for i in moved], dtype=torch.long, device=device)
            self._moved_src = torch.tensor([src0[i] for i in moved], dtype=torch.long, device=device)
        else:
            self._moved_dst = self._moved_src = NO_ROWS
        return src0

    # -------------------------------------------------- state gather/scatter

    def read_states(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input states of layer ``il`` for the micro-batch's sequences: ``[n_seqs, n_embd_r|s]``.

        Performs the data movement ``find_slot`` staged, for every cell in ``[head, head + n_rs)``:
        zeroes row ``rs_z`` when a new sequence reads it, then copies each cell whose source row is not
        its own (``s_copy(i) != head + i``: a copy-on-write, a reordered cell, a new sequence) from that
        source. All sources are read before any row is written, so a row that is both is read intact.
        Cells already in place cost nothing, so steady decode moves no data at all.

        Returns views of rows ``[head, head + n_seqs)``. A model may update them in place; it must not
        read the inputs again after ``write_states``. The moves are done once per layer and micro-batch:
        a micro-batch run as several column slices (``rsmem.memory.capture``) reads, in each later slice,
        the states the slice before wrote.
        """
        rows = self.memory.row_views.rows(il, self.head, self.ubatch.n_seqs)
        if il in self._staged:
            return rows
        self._staged.add(il)
        self._stage_moves()
        r, s = self.memory.row_views.layer(il)
        if self._zero_needed:
            r[self.rs_z].zero_()
            s[self.rs_z].zero_()
        if self._moved_dst.numel():
            r_src = r.index_select(0, self._moved_src)
            s_src = s.index_select(0, self._moved_src)
            r.index_copy_(0, self._moved_dst, r_src)
            s.index_copy_(0, self._moved_dst, s_src)
        return rows

    def write_states(self, il: int, r_out: torch.Tensor, s_out: torch.Tensor) -> None:
        """Store the micro-batch's output states of layer ``il`` in rows ``[head, head + n_seqs)``.

        Outputs that already are those rows (a model that updated the views of ``read_states`` in
        place) are left alone.
        """
        rows = self.memory.row_views.rows(il, self.head, self.ubatch.n_seqs)
        for dst, out in zip(rows, (r_out, s_out), strict=True):
            if out.data_ptr() == dst.data_ptr() and out.dtype == dst.dtype:
                continue  # the rows' own views (updated in place)
            dst.copy_(out.reshape(dst.shape))
