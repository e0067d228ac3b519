"""Exact rollback of a sequence's last positions (llama.cpp's ``n_rs_seq``): snapshots and replay.

A recurrent cell holds only a sequence's newest state, so ``seq_rm(s, p0, -1)`` cannot cut it. With
``n_rs_seq = K > 0`` the memory keeps, per sequence, enough to rebuild the state at any of its last K
positions: one or two full-state snapshots and the tokens decoded since the older one. A cut loads the
newest snapshot at or before the target ``p0 - 1`` into a scratch state outside the cells, runs the model
over the tokens between (the *replay*, through the Context's model), and only then installs the result
as the sequence's state: a refused or failed cut changes nothing. The replay is the model's own forward,
so the state is that of a fresh sequence fed the same tokens (up to the rounding of another chunking).

The window: each decoded token enters it, up to K; a cut takes the removed positions out of it (two cuts
in a row remove at most K together); a restore (``state_seq_set_data``, a checkpoint), ``seq_div`` or
removing the sequence empties it; ``seq_cp`` copies it to the destination; ``seq_add`` shifts it. A cut
deeper than the window returns False (llama.cpp's answer). State files hold the current state only, in
llama.cpp's format: the history is not saved, and a restored sequence starts with an empty window.

Snapshots (``S = max(K, MIN_SPACING)``): taken at micro-batch ends within the last K positions of a batch,
at least S tokens apart; the first decode after a restore copies the restored state. A batch with S or
more tokens before its last K is split there (``split_equal(..., tail_apart=K, min_before_tail=S)``), so
a long prompt leaves a snapshot at its window's floor; shorter batches (a speculative draft's check of
K + 1 tokens) are not split. A cut whose replay was S tokens or more keeps its result as a snapshot.
So a sequence holds at most two snapshots after each step, a replay is at most ``2S + K - 3`` tokens
(``S - 1`` after one-token decodes), and snapshot buffers no history holds are reused.

Costs: a sequence's history is at most two full states and the tokens decoded since; a snapshot is one
state copy every S tokens, small beside S decode steps, so decoding pays next to nothing for the window,
and a cut pays one replay, a forward over at most ``2S + K - 3`` tokens. The alternative, per-token
copies of the conv column plus the scan's inputs (x, dt, B) and a replay of conv and scan alone, would
write 0.44 MB (Mamba) / 0.33 MB (Mamba-2) a token per sequence (history for K = 8: 6.3 / 22 MB) and make a
cut nearly free, which matters where a cut follows most steps (speculative decoding); it needs every scan
kernel (prefill, compiled steps) to emit per-token values, which is the models' code, not the memory's.
llama.cpp b11312 keeps 1 + K full states per sequence (175 MB for Mamba-2 at K = 8).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from rsmem.batch.batch import UBatch
from rsmem.memory.state_io import can_install, install_state

if TYPE_CHECKING:
    from rsmem.memory.recurrent import RecurrentMemory

MIN_SPACING = 16  # snapshots at most every 16 tokens: the whole-state copy costs ~1/16 of a state a token


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A sequence's state after position ``pos``: a copy of each state row of one cell, in
    :func:`state_tensors` order (``None``: the zero state)."""

    pos: int
    rows: tuple[torch.Tensor, ...] | None

    @property
    def nbytes(self) -> int:
        return 0 if self.rows is None else sum(t.numel() * t.element_size() for t in self.rows)


@dataclass(slots=True)
class SeqHistory:
    """What one sequence keeps to roll back: ``tokens[i]`` is at position ``snapshots[0].pos + 1 + i``;
    the last ``window`` positions can be cut; ``snapshots`` ascend, the first at or before the floor."""

    window: int
    snapshots: list[Snapshot]
    tokens: list[int]

    @property
    def pos(self) -> int:
        """Position of the last token recorded (the cell's position)."""
        return self.snapshots[0].pos + len(self.tokens)

    def copy(self) -> SeqHistory:
        return SeqHistory(self.window, list(self.snapshots), list(self.tokens))  # snapshots are immutable


@dataclass(frozen=True, slots=True)
class CutPlan:
    """A cut to ``target``: replay ``tokens`` from ``base``; the history is ``after`` once installed."""

    target: int
    base: Snapshot
    tokens: list[int]
    after: SeqHistory


class ScratchState:
    """One sequence's rows outside the cells, shaped as the memory's: where a replay runs.

    It offers a model forward the two methods of the memory context it uses (``read_states`` and
    ``write_states``); allocated once, outside inference mode, so compiled steps see what they see on
    the memory's rows.
    """

    def __init__(self, memory: RecurrentMemory) -> None:
        def row(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else torch.zeros(1, t.shape[1], dtype=t.dtype, device=t.device)

        with torch.inference_mode(False):
            self.r_l = [row(t) for t in memory.r_l]
            self.s_l = [row(t) for t in memory.s_l]

    def tensors(self) -> list[torch.Tensor]:
        """The rows in :func:`state_tensors` order."""
        return [t for t in (*self.r_l, *self.s_l) if t is not None]

    def load(self, snapshot: Snapshot) -> None:
        if snapshot.rows is None:
            for t in self.tensors():
                t.zero_()
            return
        for dst, src in zip(self.tensors(), snapshot.rows, strict=True):
            dst[0].copy_(src)

    def read_states(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        r, s = self.r_l[il], self.s_l[il]
        if r is None or s is None:
            raise ValueError(f"layer {il} has no recurrent state in this memory")
        return r, s

    def write_states(self, il: int, r_out: torch.Tensor, s_out: torch.Tensor) -> None:
        r, s = self.read_states(il)
        for dst, out in ((r, r_out), (s, s_out)):
            if out.data_ptr() != dst.data_ptr() or out.dtype != dst.dtype:
                dst.copy_(out.reshape(dst.shape))


ReplayForward = Callable[[UBatch, ScratchState], object]


def state_tensors(memory: RecurrentMemory) -> list[torch.Tensor]:
    """The memory's state tensors, every r layer then every s layer (filtered layers skipped)."""
    return [t for t in (*memory.r_l, *memory.s_l) if t is not None]


class RollbackHistory:
    """The rollback histories of one memory's sequences, and the cut that uses them."""

    def __init__(self, memory: RecurrentMemory, n_rs_seq: int) -> None:
        if n_rs_seq < 1:
            raise ValueError(f"n_rs_seq must be positive for a rollback history, got {n_rs_seq}")
        self.n_rs_seq = n_rs_seq
        self.spacing = max(n_rs_seq, MIN_SPACING)
        self._seqs: dict[int, SeqHistory] = {}
        self._rows = SnapshotRows()
        self._scratch = ScratchState(memory)
        self._forward: ReplayForward | None = None
        self._max_tokens = 512

    def bind(self, forward: ReplayForward, max_tokens: int) -> None:
        """Lend the model: ``forward(ubatch, states)`` folds a micro-batch into ``states`` (outputs unused);
        replays are cut into micro-batches of at most ``max_tokens``. Without it no cut succeeds."""
        self._forward = forward
        self._max_tokens = max(1, max_tokens)

    # ------------------------------------------------------------- queries

    def get(self, seq_id: int) -> SeqHistory | None:
        return self._seqs.get(seq_id)

    def window(self, seq_id: int) -> int:
        """How many trailing positions of the sequence a cut may remove now."""
        h = self._seqs.get(seq_id)
        return 0 if h is None else h.window

    def nbytes(self) -> int:
        """Bytes held by snapshots (shared ones counted once, spare buffers too) and token lists."""
        return self._rows.nbytes() + 8 * sum(len(h.tokens) for h in self._seqs.values())

    # --------------------------------------------- following sequence ops

    def put(self, seq_id: int, history: SeqHistory | None) -> None:
        """Make ``history`` the sequence's (None: it has none); every change of a whole history goes here,
        so the snapshots' reference counts stay right."""
        old = self._seqs.pop(seq_id, None)
        if history is not None:
            self._seqs[seq_id] = history
            self._rows.hold(history.snapshots)
        if old is not None:
            self._rows.release(old.snapshots)

    def clear(self) -> None:
        for s in list(self._seqs):
            self.put(s, None)

    def forget_empty(self, tails: Sequence[int]) -> None:
        """Drop the histories of sequences that hold no state any more (``tails[s] < 0``)."""
        for s in [s for s in self._seqs if tails[s] < 0]:
            self.put(s, None)

    def copy(self, src: int, dst: int) -> None:
        h = self._seqs.get(src)
        self.put(dst, None if h is None else h.copy())

    def shift(self, seq_id: int, delta: int) -> None:
        """``seq_add`` moved the sequence by ``delta``: its history's positions move with it."""
        h = self._seqs.get(seq_id)
        if h is not None:
            h.snapshots = [Snapshot(s.pos + delta, s.rows) for s in h.snapshots]

    # ---------------------------------------------------------- recording

    def before_ubatch(self, memory: RecurrentMemory, ubatch: UBatch) -> None:
        """Start a history for each sequence of the micro-batch that has none, from its current state:
        the zero state just before its first position, or a copy of its cell (after a restore)."""
        cells = memory.cells
        for s in range(ubatch.n_seqs):
            seq = ubatch.seq_set(s)[0]
            if seq in self._seqs:
                continue
            c = cells.tail[seq]
            if c >= 0:
                base = Snapshot(cells.pos[c], self._rows.take(memory, c))
            else:
                base = Snapshot(ubatch.pos[s * ubatch.n_seq_tokens] - 1, None)
            self.put(seq, SeqHistory(0, [base], []))

    def after_ubatch(self, memory: RecurrentMemory, ubatch: UBatch, final_pos: dict[int, int]) -> None:
        """Record a computed micro-batch (set ``s`` now in cell ``head + s``); ``final_pos`` is each
        sequence's last position in the whole batch (snapshots are only worth taking near it)."""
        nt = ubatch.n_seq_tokens
        for s in range(ubatch.n_seqs):
            ids = ubatch.seq_set(s)
            for other in ids[1:]:  # coupled sequences now share the first one's state, not their past
                self.put(other, None)
            h = self._seqs.get(ids[0])
            end = ubatch.last_pos(s)
            if h is None or h.pos + nt != end:
                raise RuntimeError(f"rollback history of sequence {ids[0]} is out of step (bookkeeping bug)")
            h.tokens.extend(ubatch.tokens[s * nt : (s + 1) * nt])
            h.window = min(self.n_rs_seq, h.window + nt)
            if end >= final_pos[ids[0]] - self.n_rs_seq and end - h.snapshots[-1].pos >= self.spacing:
                snap = Snapshot(end, self._rows.take(memory, memory.head + s))
                h.snapshots.append(snap)
                self._rows.hold([snap])
            self._rows.release(_prune(h))

    # ---------------------------------------------------------------- cut

    def plan_cut(self, seq_id: int, pos: int, p0: int) -> CutPlan | None:
        """The plan to remove positions ``[p0, pos]``; None when they are not all in the window."""
        h = self._seqs.get(seq_id)
        if h is None or h.pos != pos or not 1 <= pos - p0 + 1 <= h.window:
            return None
        target = p0 - 1
        kept = [s for s in h.snapshots if s.pos <= target]
        base, first = kept[-1], h.snapshots[0].pos
        after = SeqHistory(h.window - (pos - target), kept, h.tokens[: target - first])
        return CutPlan(target, base, h.tokens[base.pos - first : target - first], after)

    def cut(self, memory: RecurrentMemory, seq_id: int, p0: int) -> bool:
        """Roll ``seq_id`` back to position ``p0 - 1``: True when done; False, with nothing changed, when the
        cut is deeper than the window, no model was bound or no cell is free for a shared sequence."""
        plan = self.plan_cut(seq_id, memory.seq_pos_max(seq_id), p0)
        if plan is None or self._forward is None or not can_install(memory, seq_id):
            return False
        scratch = self._scratch
        scratch.load(plan.base)
        pos = plan.base.pos + 1
        for i in range(0, len(plan.tokens), self._max_tokens):
            chunk = plan.tokens[i : i + self._max_tokens]
            self._forward(UBatch.of_sequence(seq_id, chunk, pos), scratch)
            pos += len(chunk)
        install_state(memory, seq_id, plan.target, lambda cell: _copy_into_cell(memory, scratch, cell))
        after = plan.after
        if plan.target - plan.base.pos >= self.spacing:  # a long replay: the next one starts from here
            after.snapshots.append(Snapshot(plan.target, self._rows.take(memory, memory.cells.tail[seq_id])))
            _prune(after)
        self.put(seq_id, after)
        return True

    # ---------------------------------------------------------- invariants

    def check(self, memory: RecurrentMemory) -> None:
        """Raise AssertionError if a history disagrees with the cells (tests and debugging)."""
        for seq, h in self._seqs.items():
            assert memory.cells.tail[seq] >= 0, f"empty sequence {seq} has a rollback history"
            assert h.pos == memory.seq_pos_max(seq), f"history of seq {seq} ends at {h.pos}"
            assert 0 <= h.window <= self.n_rs_seq, f"window {h.window} of seq {seq}"
            assert h.snapshots[0].pos <= h.pos - h.window, f"seq {seq} has no snapshot at its floor"
            assert all(a.pos < b.pos for a, b in zip(h.snapshots, h.snapshots[1:]))
        self._rows.check([s for h in self._seqs.values() for s in h.snapshots])


def _prune(h: SeqHistory) -> list[Snapshot]:
    """Keep the newest snapshot at or before the window's floor and those after it; drop older tokens.
    Returns the snapshots dropped."""
    floor = h.pos - h.window
    keep = max(i for i, s in enumerate(h.snapshots) if s.pos <= floor)
    dropped = h.snapshots[:keep]
    if keep:
        del h.tokens[: h.snapshots[keep].pos - h.snapshots[0].pos]
        del h.snapshots[:keep]
    return dropped


class SnapshotRows:
    """The row buffers of snapshots, counted by the histories holding them (``seq_cp`` shares them); a
    buffer none holds any more is kept for the next snapshot, up to ``SPARE`` of them. Reuse matters:
    a fresh buffer as large as a Mamba-2 130M state (19 MB) page-faults its way in, and a copy into it
    takes many times as long as into a used one."""

    SPARE = 4

    def __init__(self) -> None:
        self._refs: dict[int, tuple[tuple[torch.Tensor, ...], int]] = {}  # id(rows) -> (rows, count)
        self._spare: list[tuple[torch.Tensor, ...]] = []

    def take(self, memory: RecurrentMemory, cell: int) -> tuple[torch.Tensor, ...]:
        """A copy of every state row of ``cell`` (held by nobody yet: :meth:`hold` it)."""
        rows = state_tensors(memory)
        if self._spare:
            buf = self._spare.pop()
        else:
            with torch.inference_mode(False):  # a plain tensor: writable in and out of inference mode
                buf = tuple(torch.empty_like(t[cell]) for t in rows)
        for dst, t in zip(buf, rows, strict=True):
            dst.copy_(t[cell])
        return buf

    def hold(self, snapshots: Sequence[Snapshot]) -> None:
        """Count one more holder of each snapshot's rows (taking them back from the spares: a history
        dropped and put back, as a dry run does, holds the same rows again)."""
        for s in snapshots:
            if s.rows is None:
                continue
            _, n = self._refs.get(id(s.rows), (s.rows, 0))
            if n == 0:
                self._spare = [rows for rows in self._spare if rows is not s.rows]
            self._refs[id(s.rows)] = (s.rows, n + 1)

    def release(self, snapshots: Sequence[Snapshot]) -> None:
        for s in snapshots:
            if s.rows is None:
                continue
            rows, n = self._refs[id(s.rows)]
            if n > 1:
                self._refs[id(s.rows)] = (rows, n - 1)
                continue
            del self._refs[id(s.rows)]
            if len(self._spare) < self.SPARE:
                self._spare.append(rows)

    def check(self, held: Sequence[Snapshot]) -> None:
        """Raise AssertionError unless the counts are those of ``held`` (every history's snapshots)."""
        counts: dict[int, int] = {}
        for s in held:
            if s.rows is not None:
                counts[id(s.rows)] = counts.get(id(s.rows), 0) + 1
        assert counts == {k: n for k, (_, n) in self._refs.items()}, "snapshot reference counts are off"
        assert not any(id(rows) in counts for rows in self._spare), "a held snapshot is a spare buffer"

    def nbytes(self) -> int:
        held = [rows for rows, _ in self._refs.values()] + self._spare
        return sum(t.numel() * t.element_size() for rows in held for t in rows)


def _copy_into_cell(memory: RecurrentMemory, scratch: ScratchState, cell: int) -> None:
    for dst, src in zip(state_tensors(memory), scratch.tensors(), strict=True):
        dst[cell].copy_(src[0])
