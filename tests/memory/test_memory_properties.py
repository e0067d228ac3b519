"""Random sequences of decodes and sequence operations, checked after every step.

The memory's invariants (one tail per sequence, tails agreeing with seq sets, ``used`` counting non-empty
cells, ``prepare`` changing nothing) must hold throughout, and the toy model's outputs must equal the
same operations replayed on a plain model: per sequence a token history, a position and the cell it
shares with others (an abstract id), each operation written from llama.cpp's semantics (SPEC section 1,
``llama-memory-recurrent.cpp``) and rsmem's documented differences, never read back from the memory.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from helpers.memory import snapshot
from rsmem import Batch, BatchAllocator, Context
from rsmem.errors import UnknownSequenceError
from rsmem.memory.recurrent import POS_MAX
from rsmem.models import DecayedSumModel

pytestmark = pytest.mark.fuzz

N_SEQ = 5
MODEL = DecayedSumModel(n_vocab=16, n_embd=3, n_layer=2, seed=1)
token_lists = st.lists(st.integers(0, 15), min_size=1, max_size=4)


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = Context(MODEL, n_seq_max=N_SEQ, n_ubatch=6)
        self.history: dict[int, list[int]] = {}  # seq -> tokens folded into its state
        self.pos: dict[int, int] = {}  # seq -> last position
        self.cell: dict[int, int] = {}  # seq -> the cell it holds, an abstract id: equal ids share a cell
        self.new_cells = itertools.count()

    @property
    def mem(self):
        return self.ctx.memory

    def forget(self, seq: int) -> None:
        for d in (self.pos, self.history, self.cell):
            d.pop(seq, None)

    def sharers(self, seq: int) -> list[int]:
        """Sequences on ``seq``'s cell, ``seq`` included: a position change moves them all."""
        return [s for s, c in self.cell.items() if c == self.cell[seq]]

    def target(self, data: st.DataObject) -> int:
        """A sequence that holds a state, as often one that shares its cell as not (when any does)."""
        shared = [s for s in sorted(self.pos) if len(self.sharers(s)) > 1]
        held = st.sampled_from(sorted(self.pos))
        return data.draw(st.one_of(held, st.sampled_from(shared)) if shared else held, label="seq")

    def pos_range(self, data: st.DataObject, seq: int) -> tuple[int, int]:
        """``p0, p1`` (-1: from 0 / to the end): mostly at the boundaries around ``seq``'s position P,
        sometimes anywhere. Offsets from P are drawn, not values: hypothesis likes to repeat a value
        within a test case, and p0 == p1 would be an empty range."""
        P = self.pos.get(seq, 0)
        off0 = data.draw(st.sampled_from([None, -2, -1, 0, 1, "any"]), label="p0 - P")
        off1 = data.draw(st.sampled_from([None, 0, 1, 2, "any"]), label="p1 - P")
        ends = []
        for off in (off0, off1):
            if off == "any":
                ends.append(data.draw(st.integers(0, 24), label="end"))
            else:
                ends.append(-1 if off is None else max(P + off, 0))
        return ends[0], ends[1]

    @initialize(data=st.data(), seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=2, max_size=N_SEQ))
    def start(self, data, seqs):
        """Begin with a few sequences holding states, some sharing a cell, so that every operation
        meets some."""
        self.decode_prompts(data, seqs)
        for dst in data.draw(st.sets(st.integers(0, N_SEQ - 1), max_size=2), label="forks"):
            self.copy(min(seqs), dst)

    @rule(data=st.data(), seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=1, max_size=N_SEQ))
    def decode(self, data, seqs):
        self.decode_prompts(data, seqs)

    def decode_prompts(self, data: st.DataObject, seqs: set[int]) -> None:
        prompts = {s: data.draw(token_lists, label=f"tokens of {s}") for s in sorted(seqs)}
        self.ctx.decode(Batch.from_sequences(prompts))
        for k, (s, toks) in enumerate(prompts.items()):
            self.history[s] = self.history.get(s, []) + toks
            self.pos[s] = self.pos.get(s, -1) + len(toks)
            self.cell[s] = next(self.new_cells)  # a written sequence owns its cell (copy-on-write)
            want = MODEL.reference_logits(self.history[s])[-1]
            torch.testing.assert_close(self.ctx.logits[k], want, atol=1e-4, rtol=1e-5)

    @rule(seq=st.integers(-1, N_SEQ), p0=st.integers(-1, 12), p1=st.integers(-1, 14))
    def seq_rm(self, seq, p0, p1):
        lo, hi = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        if seq >= N_SEQ:
            expected = False
        elif seq >= 0:
            P = self.pos.get(seq)
            expected = not (P is not None and 0 < lo <= P < hi)
        else:
            expected = lo == hi or (lo == 0 and hi == POS_MAX)
        assert self.mem.seq_rm(seq, p0, p1) is expected
        if expected:
            for s in [s for s in self.pos if (seq < 0 or s == seq) and lo <= self.pos[s] < hi]:
                self.forget(s)

    @rule(data=st.data(), dst=st.integers(0, N_SEQ - 1))
    def seq_cp(self, data, dst):
        held = st.sampled_from(sorted(self.pos)) if self.pos else st.nothing()
        self.copy(data.draw(st.one_of(held, st.integers(0, N_SEQ - 1)), label="src"), dst)

    def copy(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        if src != dst:
            self.forget(dst)
            if src in self.pos:
                self.pos[dst], self.history[dst] = self.pos[src], list(self.history[src])
                self.cell[dst] = self.cell[src]

    @rule(seq=st.integers(0, N_SEQ - 1))
    def seq_keep(self, seq):
        self.mem.seq_keep(seq)
        for s in [s for s in self.pos if s != seq]:
            self.forget(s)

    def shift_position(self, op: str, seq: int, p0: int, p1: int, arg: int) -> None:
        """``seq_add`` (``arg`` = delta) or ``seq_div`` (``arg`` = divisor) on the model and the memory.

        llama.cpp: p0 < 0 means 0, p1 < 0 the end; nothing happens for delta 0 / divisor 1 or an empty
        range; else the tail cell's position P changes when p0 <= P < p1 (P + delta, or P / d rounded
        toward zero), so every sequence sharing that cell moves too. rsmem raises UnknownSequenceError
        for a seq id outside [0, n_seq_max) (llama.cpp ignores it), ValueError for a divisor below 1
        and for a shift below position 0, each with the memory unchanged."""
        call = getattr(self.mem, op)
        if not 0 <= seq < N_SEQ:
            before = snapshot(self.mem)
            with pytest.raises(UnknownSequenceError, match=f"seq_id {seq} is outside"):
                call(seq, p0, p1, arg)
            before.assert_same(snapshot(self.mem))
            return
        if op == "seq_div" and arg < 1:
            before = snapshot(self.mem)
            with pytest.raises(ValueError, match="divisor must be positive"):
                call(seq, p0, p1, arg)
            before.assert_same(snapshot(self.mem))
            return
        lo, hi = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        identity = arg == 0 if op == "seq_add" else arg == 1
        P = self.pos.get(seq)
        if identity or lo == hi or P is None or not lo <= P < hi:
            new = P
        else:
            new = P + arg if op == "seq_add" else P // arg  # P >= 0, arg >= 2: C++ division
        if new is not None and new < 0:
            before = snapshot(self.mem)
            with pytest.raises(ValueError, match="below zero"):
                call(seq, p0, p1, arg)
            before.assert_same(snapshot(self.mem))
            return
        call(seq, p0, p1, arg)
        if new is not None:
            for s in self.sharers(seq):
                self.pos[s] = new

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), delta=st.integers(-6, 6))
    def seq_add(self, data, delta):
        seq = self.target(data)
        self.shift_position("seq_add", seq, *self.pos_range(data, seq), delta)

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), d=st.integers(-1, 4))
    def seq_div(self, data, d):
        seq = self.target(data)
        self.shift_position("seq_div", seq, *self.pos_range(data, seq), d)

    @rule(
        data=st.data(),
        op=st.sampled_from(["seq_add", "seq_div"]),
        seq=st.integers(-1, N_SEQ),
        arg=st.integers(-3, 3),
    )
    def shift_any_sequence(self, data, op, seq, arg):
        """Either operation on any id: empty sequences (nothing happens) and ids out of range."""
        self.shift_position(op, seq, *self.pos_range(data, seq), arg)

    @rule(data=st.data())
    def save_and_restore(self, data):
        src = data.draw(st.integers(0, N_SEQ - 1))
        dst = data.draw(st.integers(0, N_SEQ - 1))
        blob = self.ctx.state_seq_get_data(src)
        self.ctx.state_seq_set_data(blob, dst)
        if src != dst or src not in self.pos:
            self.forget(dst)
        if src in self.pos:
            self.pos[dst], self.history[dst] = self.pos[src], list(self.history[src])
            self.cell[dst] = next(self.new_cells)  # a restore gives the sequence a cell of its own

    @rule()
    def clear(self):
        self.mem.clear(data=bool(self.pos))
        self.pos.clear()
        self.history.clear()
        self.cell.clear()

    @invariant()
    def bookkeeping_is_consistent(self):
        self.mem.check_invariants()
        for s in range(N_SEQ):
            assert self.mem.seq_pos_max(s) == self.pos.get(s, -1)
            assert self.mem.seq_pos_min(s) == self.pos.get(s, -1)

    @invariant()
    def cells_are_shared_as_modelled(self):
        tail = self.mem.cells.tail
        for s, t in itertools.combinations(sorted(self.cell), 2):
            assert (tail[s] == tail[t]) == (self.cell[s] == self.cell[t]), (s, t)
        assert self.mem.used == len(set(self.cell.values()))

    @invariant()
    def prepare_changes_nothing(self):
        before = snapshot(self.mem)
        balloc = BatchAllocator()
        batch = Batch.from_sequences({s: [1, 2] for s in range(N_SEQ)})
        balloc.init(batch, n_vocab=16, n_seq_max=N_SEQ, memory=self.mem)
        self.mem.init_batch(balloc, n_ubatch=4)
        before.assert_same(snapshot(self.mem))


MemoryMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestMemoryMachine = MemoryMachine.TestCase
