"""The recurrent-state memory: llama.cpp's ``llama_memory_recurrent`` for Python.

One fixed-size state per sequence, per recurrent layer: an ``r`` row (conv window / token shift) and an
``s`` row (SSM / WKV state). Sequences fork without copying (``seq_cp`` shares a cell; ``find_slot`` copies
it on the next write), and every sequence operation keeps llama.cpp's semantics and return values.

The metadata lives in a :class:`~rsmem.memory.cells.CellTable`; this class owns the tensors and the
operations. Data never moves here: ``find_slot`` only stages, per cell, the row its state must be read
from (``src0``), and the model's gather through the memory context performs the move.

With ``n_rs_seq = K > 0`` a :class:`~rsmem.memory.rollback.RollbackHistory` lets ``seq_rm`` cut a
sequence's last K positions exactly (see :mod:`rsmem.memory.rollback`); with 0 nothing of it exists.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rsmem.batch.allocator import BatchAllocator
from rsmem.batch.batch import UBatch
from rsmem.errors import UnknownSequenceError
from rsmem.hugepages import huge_page_zeros
from rsmem.memory import state_io
from rsmem.memory.cells import CellTable
from rsmem.memory.context import MemoryStatus, RecurrentMemoryContext, RowViews
from rsmem.memory.rollback import RollbackHistory

POS_MAX = 2**31 - 1  # llama_pos is int32; p1 < 0 means "to the end"


@dataclass(frozen=True, slots=True)
class StateShape:
    """The size of one sequence's state: what the model declares and the memory allocates."""

    n_layer: int
    n_embd_r: int
    n_embd_s: int


class RecurrentMemory:
    """Cells of recurrent state, one per sequence at most, with llama.cpp's sequence operations.

    ``size = max(1, n_seq_max)``; seq ids are in ``[0, size)``. ``layer_filter(il)`` returning False
    leaves layer ``il`` without state (hybrid models keep attention layers elsewhere). ``n_rs_seq``:
    how many trailing positions ``seq_rm`` may cut (0: none, llama.cpp's recurrent memory); cuts need a
    model bound to ``rollback`` (the Context does it).
    """

    def __init__(
        self,
        shape: StateShape,
        n_seq_max: int = 1,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        layer_filter: Callable[[int], bool] | None = None,
        n_rs_seq: int = 0,
    ) -> None:
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"state dtype must be float32, float16 or bfloat16, got {dtype}")
        if n_rs_seq < 0:
            raise ValueError(f"n_rs_seq must be 0 or more, got {n_rs_seq}")
        self.shape = shape
        self.n_seq_max = max(1, n_seq_max)
        self.size = self.n_seq_max
        self.dtype = dtype
        self.device = torch.device(device)
        kept = [il for il in range(shape.n_layer) if layer_filter is None or layer_filter(il)]
        rows = self._zeros([(self.size, n) for _ in kept for n in (shape.n_embd_r, shape.n_embd_s)])
        self.r_l: list[torch.Tensor | None] = [None] * shape.n_layer
        self.s_l: list[torch.Tensor | None] = [None] * shape.n_layer
        for k, il in enumerate(kept):
            self.r_l[il], self.s_l[il] = rows[2 * k], rows[2 * k + 1]
        self.row_views = RowViews(self.r_l, self.s_l)  # what read_states hands out
        self.cells = CellTable.empty(self.size)
        self.head = 0
        self.used = 0
        self.n = 0  # cells [head, head+n) touched by the last find_slot
        self.rs_z = -1  # a cell in that range with no references: its row is zeroed for new sequences
        self.rollback = RollbackHistory(self, n_rs_seq) if n_rs_seq else None

    def _zeros(self, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
        """The state tensors; on the CPU large ones live on huge pages, where they stream faster
        (:mod:`rsmem.hugepages`)."""
        if self.device.type == "cpu":
            return huge_page_zeros(shapes, self.dtype)
        return [torch.zeros(s, dtype=self.dtype, device=self.device) for s in shapes]

    # ----------------------------------------------------------------- sizes

    @property
    def n_layer(self) -> int:
        return self.shape.n_layer

    def size_r_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.r_l if t is not None)

    def size_s_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.s_l if t is not None)

    def total_size(self) -> int:
        return self.size_r_bytes() + self.size_s_bytes()

    def state_bytes_per_seq(self) -> int:
        return self.total_size() // self.size

    @property
    def n_rs_seq(self) -> int:
        """How many trailing positions of a sequence ``seq_rm`` may cut (0: none)."""
        return 0 if self.rollback is None else self.rollback.n_rs_seq

    @property
    def kv_cells_per_seq(self) -> None:
        """No KV cache bounds a sequence's positions."""
        return None

    def capture_memory(self) -> RecurrentMemory:
        return self

    # state bytes (llama.cpp's recurrent payload): written and read by rsmem.memory.state_io
    state_write = state_io.write_payload
    state_read = state_io.read_state

    # ------------------------------------------------------- sequence queries

    def require_seq(self, seq_id: int, what: str) -> None:
        """Raise UnknownSequenceError (naming ``what`` was asked) unless ``0 <= seq_id < size``."""
        if not 0 <= seq_id < self.size:
            raise UnknownSequenceError(f"{what}: seq_id {seq_id} is outside [0, {self.size})")

    def seq_pos_min(self, seq_id: int) -> int:
        """Smallest position of the sequence: for a recurrent state, its tail's position (-1 if empty)."""
        return self.seq_pos_max(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        """Position of the last token folded into the sequence's state (-1 if empty)."""
        self.require_seq(seq_id, "seq_pos_max")
        c = self.cells.tail[seq_id]
        return self.cells.pos[c] if c >= 0 else -1

    def seq_ids(self) -> list[int]:
        """Sequences that currently hold state, in id order."""
        return [s for s, c in enumerate(self.cells.tail) if c >= 0]

    # ---------------------------------------------------- sequence operations

    def clear(self, data: bool = True) -> None:
        """Empty every cell; with ``data`` also zero the state tensors."""
        self.cells = CellTable.empty(self.size)
        self.head = 0
        self.used = 0
        if self.rollback is not None:
            self.rollback.clear()
        if data:
            for t in (*self.r_l, *self.s_l):
                if t is not None:
                    t.zero_()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove the positions ``[p0, p1)`` of a sequence (all sequences when ``seq_id < 0``).

        A recurrent state cannot be cut: False when ``0 < p0 <= P < p1`` for the tail position P, or
        for ``seq_id < 0`` with a range that is neither everything nor nothing, or ``seq_id >= size``.
        A range ending at or before P changes nothing and returns True. With ``n_rs_seq`` a cut that
        removes only positions of the sequence's rollback window returns True and leaves exactly the
        state at ``p0 - 1`` (deeper cuts return False and change nothing).
        """
        p0 = max(p0, 0)
        if p1 < 0:
            p1 = POS_MAX
        if seq_id >= self.size:
            return False
        cells = self.cells
        if seq_id >= 0:
            c = cells.tail[seq_id]
            if c >= 0 and 0 < p0 <= cells.pos[c] < p1:
                return self.rollback is not None and self.rollback.cut(self, seq_id, p0)
        elif p0 != p1 and (p0 != 0 or p1 != POS_MAX):
            return False
        new_head = self.size
        for c in range(self.size):
            if not (p0 <= cells.pos[c] < p1) or not cells.seqs[c]:
                continue
            if seq_id < 0:
                for s in cells.seqs[c]:
                    cells.tail[s] = -1
                cells.free(c)
                freed = True
            elif seq_id in cells.seqs[c]:
                freed = cells.detach(seq_id)
            else:
                continue
            if freed:
                self.used -= 1
                new_head = min(new_head, c)
        if new_head < self.head:
            self.head = new_head
        if self.rollback is not None:
            self.rollback.forget_empty(cells.tail)
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Make ``dst`` share ``src``'s state (the range is ignored: a state is all or nothing).

        No data is copied; the shared cell is copied on the first write to either sequence.
        """
        del p0, p1
        self.require_seq(seq_id_src, "seq_cp source")
        self.require_seq(seq_id_dst, "seq_cp destination")
        if seq_id_src == seq_id_dst:
            return
        cells = self.cells
        if cells.detach(seq_id_dst):
            self.used -= 1
        c = cells.tail[seq_id_src]
        if c >= 0:
            cells.seqs[c].add(seq_id_dst)
            cells.tail[seq_id_dst] = c
        if self.rollback is not None:
            self.rollback.copy(seq_id_src, seq_id_dst)

    def seq_keep(self, seq_id: int) -> None:
        """Drop every sequence but ``seq_id``."""
        self.require_seq(seq_id, "seq_keep")
        cells = self.cells
        new_head = self.size
        for s in range(self.size):
            if s != seq_id:
                cells.tail[s] = -1
        for c in range(self.size):
            if seq_id in cells.seqs[c]:
                cells.seqs[c] = {seq_id}
            else:
                if cells.seqs[c]:
                    self.used -= 1
                cells.free(c)
                new_head = min(new_head, c)
        if new_head < self.head:
            self.head = new_head
        if self.rollback is not None:
            self.rollback.forget_empty(cells.tail)

    def _tail_in_range(self, seq_id: int, p0: int, p1: int) -> int:
        c = self.cells.tail[seq_id]
        if c >= 0 and p0 <= self.cells.pos[c] < p1:
            return c
        return -1

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Shift the sequence's position by ``shift`` if it lies in ``[p0, p1)``; the state is unchanged."""
        self.require_seq(seq_id, "seq_add")
        p0, p1 = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        if shift == 0 or p0 == p1:
            return
        c = self._tail_in_range(seq_id, p0, p1)
        if c >= 0:
            new_pos = self.cells.pos[c] + shift
            if new_pos < 0:
                raise ValueError(
                    f"seq_add: shifting sequence {seq_id} by {shift} would move position "
                    f"{self.cells.pos[c]} below zero"
                )
            self.cells.pos[c] = new_pos
            if self.rollback is not None:
                for s in self.cells.seqs[c]:  # every sharer of the cell moved
                    self.rollback.shift(s, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the sequence's position by ``d`` (integer division) if it lies in ``[p0, p1)``."""
        self.require_seq(seq_id, "seq_div")
        if d <= 0:
            raise ValueError(f"seq_div: divisor must be positive, got {d}")
        p0, p1 = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        if d == 1 or p0 == p1:
            return
        c = self._tail_in_range(seq_id, p0, p1)
        if c >= 0:
            self.cells.pos[c] //= d
            if self.rollback is not None:  # a divided history no longer lines up with its tokens
                for s in self.cells.seqs[c]:
                    self.rollback.put(s, None)

    # ------------------------------------------------------ batch processing

    def init_batch(
        self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False
    ) -> RecurrentMemoryContext:
        """Split the batch into equal-sequence micro-batches and dry-run their placement.

        Returns a context whose status is FAILED_PREPARE when the tokens could not all be split or
        placed; the memory is unchanged either way (only ``apply`` changes it). ``split_equal`` runs
        non-sequential: the memory reorders cells itself, so any set of sequences decodes in one step;
        with ``n_rs_seq`` it ends a micro-batch ``n_rs_seq`` tokens before the end of each sequence that
        has at least a snapshot spacing of tokens before those (see :mod:`rsmem.memory.rollback`).
        """
        balloc.split_reset()
        ubatches: list[UBatch] = []
        tail, before = (0, 1) if self.rollback is None else (self.rollback.n_rs_seq, self.rollback.spacing)
        while True:
            ub = balloc.split_seq(n_ubatch) if embd_all else balloc.split_equal(n_ubatch, False, tail, before)
            if ub is None:
                break
            ubatches.append(ub)
        if balloc.n_used < balloc.n_tokens or not self.prepare(ubatches):
            return RecurrentMemoryContext(self, [], MemoryStatus.FAILED_PREPARE)
        return RecurrentMemoryContext(self, ubatches, MemoryStatus.SUCCESS)

    def init_full(self) -> RecurrentMemoryContext:
        """A context spanning every cell (used to reserve compute for a worst-case step)."""
        return RecurrentMemoryContext(self, [], MemoryStatus.SUCCESS, is_full=True)

    def init_update(self) -> RecurrentMemoryContext:
        """A recurrent memory never needs an update pass (no shifts or defragmentation to apply)."""
        return RecurrentMemoryContext(self, [], MemoryStatus.NO_UPDATE)

    def prepare(self, ubatches: Sequence[UBatch]) -> bool:
        """Dry-run ``find_slot`` for every micro-batch; the metadata is restored afterwards."""
        saved = (self.cells.copy(), self.head, self.used, self.n, self.rs_z)
        try:
            return all(self.find_slot(ub) for ub in ubatches)
        finally:
            self.cells, self.head, self.used, self.n, self.rs_z = saved

    def find_slot(self, ubatch: UBatch) -> bool:
        """Give each sequence set of the micro-batch its own cell, contiguous from ``head``.

        A sequence sharing its cell gets a free cell that reads the shared row (copy-on-write); a new
        sequence reads the zero row ``rs_z``. Cells are then swapped so that set ``s`` lands in cell
        ``head + s``, and ``src0`` records where each touched cell's data must be gathered from.
        Returns False (metadata possibly changed: call through ``prepare`` first) if a seq id is out of
        range or no free cell is left.
        """
        if not ubatch.equal_seqs:
            return False
        cells = self.cells
        n_seqs = ubatch.n_seqs
        if self.head > self.used + 2 * n_seqs:
            self.head = 0
        sets = [ubatch.seq_set(s) for s in range(n_seqs)]
        for ids in sets:
            for seq in ids:
                if not 0 <= seq < self.size:
                    return False
            for seq in ids[1:]:  # coupled sequences lose their own cells; they join the first one's
                if cells.detach(seq):
                    self.used -= 1

        free = self._free_cells()
        lo, hi = self.size - 1, 0
        for ids in sets:
            seq = ids[0]
            c = cells.tail[seq]
            if c < 0 or len(cells.seqs[c]) > 1:
                e = next(free, -1)
                if e < 0:
                    return False
                if c >= 0:  # copy-on-write: the new cell reads the shared cell's row
                    cells.pos[e], cells.src[e] = cells.pos[c], cells.src[c]
                    cells.seqs[c].discard(seq)
                cells.seqs[e] = {seq}  # claim it now, so the free scan skips it
                cells.tail[seq] = c = e
            lo, hi = min(lo, c), max(hi, c)

        for s, ids in enumerate(sets):
            cells.swap(lo + s, cells.tail[ids[0]])
        for s, ids in enumerate(sets):
            c = lo + s
            last = ubatch.last_pos(s)
            # llama.cpp logs "non-consecutive token position" when last != pos + n_seq_tokens
            cells.pos[c] = last
            cells.seqs[c] = set(ids)
            for seq in ids:
                cells.tail[seq] = c

        referenced = {src for src in cells.src if src >= 0}
        self.rs_z = next((c for c in range(lo, hi + 1) if c not in referenced), -1)
        for c in range(lo, hi + 1):
            if cells.src[c] < 0:
                if self.rs_z < 0:
                    return False
                cells.src0[c] = self.rs_z
            else:
                cells.src0[c] = cells.src[c]
            cells.src[c] = c
        self.head = lo
        self.n = hi - lo + 1
        self.used = cells.n_used()
        return self.n >= n_seqs

    def _free_cells(self) -> Iterator[int]:
        """Empty cells in circular order from ``head``, skipping those claimed since the scan began."""
        for k in range(self.size):
            c = (self.head + k) % self.size
            if not self.cells.seqs[c]:
                yield c

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (tests and debugging)."""
        cells = self.cells
        owner: dict[int, int] = {}
        for c in range(self.size):
            for s in cells.seqs[c]:
                assert 0 <= s < self.size, f"cell {c} holds out-of-range seq {s}"
                assert s not in owner, f"seq {s} is in cells {owner[s]} and {c}"
                owner[s] = c
            if cells.seqs[c]:
                assert cells.pos[c] >= 0, f"cell {c} is used but has pos {cells.pos[c]}"
        for s in range(self.size):
            assert cells.tail[s] == owner.get(s, -1), (
                f"tail of seq {s} is {cells.tail[s]}, not {owner.get(s, -1)}"
            )
        assert self.used == cells.n_used(), f"used is {self.used}, {cells.n_used()} cells are in use"
        if self.rollback is not None:
            self.rollback.check(self)
