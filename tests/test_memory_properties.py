"""Random sequences of decodes and sequence operations, checked after every step.

The memory's invariants (one tail per sequence, tails agreeing with seq sets, ``used`` counting non-empty
cells, ``prepare`` changing nothing) must hold throughout, and the toy model's outputs must equal the
same operations replayed on plain per-sequence Python state (a token history and a position).
"""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from memory_helpers import snapshot
from rsmem import Batch, BatchAllocator, Context
from rsmem.memory.recurrent import POS_MAX
from rsmem.models import DecayedSumModel

N_SEQ = 5
MODEL = DecayedSumModel(n_vocab=16, n_embd=3, n_layer=2, seed=1)
token_lists = st.lists(st.integers(0, 15), min_size=1, max_size=4)


class MemoryMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx = Context(MODEL, n_seq_max=N_SEQ, n_ubatch=6)
        self.history: dict[int, list[int]] = {}  # seq -> tokens folded into its state
        self.pos: dict[int, int] = {}  # seq -> last position

    @property
    def mem(self):
        return self.ctx.memory

    @rule(data=st.data(), seqs=st.sets(st.integers(0, N_SEQ - 1), min_size=1, max_size=N_SEQ))
    def decode(self, data, seqs):
        prompts = {s: data.draw(token_lists, label=f"tokens of {s}") for s in sorted(seqs)}
        self.ctx.decode(Batch.from_sequences(prompts))
        for k, (s, toks) in enumerate(prompts.items()):
            self.history[s] = self.history.get(s, []) + toks
            self.pos[s] = self.pos.get(s, -1) + len(toks)
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
                del self.pos[s], self.history[s]

    @rule(src=st.integers(0, N_SEQ - 1), dst=st.integers(0, N_SEQ - 1))
    def seq_cp(self, src, dst):
        self.mem.seq_cp(src, dst)
        if src != dst:
            self.pos.pop(dst, None)
            self.history.pop(dst, None)
            if src in self.pos:
                self.pos[dst], self.history[dst] = self.pos[src], list(self.history[src])

    @rule(seq=st.integers(0, N_SEQ - 1))
    def seq_keep(self, seq):
        self.mem.seq_keep(seq)
        self.pos = {s: p for s, p in self.pos.items() if s == seq}
        self.history = {s: h for s, h in self.history.items() if s == seq}

    @precondition(lambda self: self.pos)
    @rule(data=st.data(), shift=st.integers(1, 5))
    def seq_add(self, data, shift):
        seq = data.draw(st.sampled_from(sorted(self.pos)))
        self.mem.seq_add(seq, -1, -1, shift)
        # every sequence sharing the cell moves with it
        cell = self.mem.cells.tail[seq]
        for s in self.mem.cells.seqs[cell]:
            self.pos[s] = self.mem.seq_pos_max(s)
        assert self.pos[seq] == self.mem.seq_pos_max(seq)

    @rule(data=st.data())
    def save_and_restore(self, data):
        src = data.draw(st.integers(0, N_SEQ - 1))
        dst = data.draw(st.integers(0, N_SEQ - 1))
        blob = self.ctx.state_seq_get_data(src)
        self.ctx.state_seq_set_data(blob, dst)
        if src != dst or src not in self.pos:
            self.pos.pop(dst, None)
            self.history.pop(dst, None)
        if src in self.pos:
            self.pos[dst], self.history[dst] = self.pos[src], list(self.history[src])

    @rule()
    def clear(self):
        self.mem.clear(data=bool(self.pos))
        self.pos.clear()
        self.history.clear()

    @invariant()
    def bookkeeping_is_consistent(self):
        self.mem.check_invariants()
        for s in range(N_SEQ):
            assert self.mem.seq_pos_max(s) == self.pos.get(s, -1)

    @invariant()
    def prepare_changes_nothing(self):
        before = snapshot(self.mem)
        balloc = BatchAllocator()
        batch = Batch.from_sequences({s: [1, 2] for s in range(N_SEQ)})
        balloc.init(batch, n_vocab=16, n_seq_max=N_SEQ, memory=self.mem)
        self.mem.init_batch(balloc, n_ubatch=4)
        before.assert_same(snapshot(self.mem))


MemoryMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestMemoryMachine = MemoryMachine.TestCase
