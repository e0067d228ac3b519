"""Random decodes and sequence operations on a hybrid memory (LFM2), against a plain model of both parts.

The plain model: per sequence the position of its recurrent state and the cell it shares (an abstract id,
so ``seq_add`` moves every sharer), and the stored attention tokens (position, sequences). Each operation is
written from llama-memory-hybrid.cpp's rules (recurrent part first; a refusal changes nothing) over the
recurrent memory's and the KV cache's own rules, never read back from the memory. After every step each
part's positions, the combined ``seq_pos_min`` / ``seq_pos_max`` and the invariants must agree.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

import rsmem
from rsmem import Batch, Context
from rsmem.errors import NoSlotError
from rsmem.memory.hybrid import HybridMemory

pytestmark = pytest.mark.fuzz

N = 3
MODEL = rsmem.load_model(
    Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "lfm2" / "model-f32.gguf"
)
POS_MAX = 2**31 - 1


class HybridMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.ctx: Context | None = None
        self.cell: dict[int, int] = {}  # seq -> abstract recurrent cell
        self.cell_pos: dict[int, int] = {}  # abstract cell -> position
        self.kv: list[tuple[int, set[int]]] = []
        self.ids = itertools.count()

    @property
    def mem(self) -> HybridMemory:
        assert self.ctx is not None and isinstance(self.ctx.memory, HybridMemory)
        return self.ctx.memory

    @initialize(unified=st.booleans())
    def start(self, unified: bool) -> None:
        self.ctx = Context(
            MODEL, n_seq_max=N, n_ctx=24 if unified else 3 * 256, kv_unified=unified, n_ubatch=5
        )

    def rec_pos(self, s: int) -> int:
        return self.cell_pos[self.cell[s]] if s in self.cell else -1

    def kv_pos(self, s: int) -> list[int]:
        return sorted(p for p, seqs in self.kv if s in seqs)

    def pos_max(self, s: int) -> int:
        return min(max(self.kv_pos(s), default=-1), self.rec_pos(s))

    @rule(data=st.data())
    def decode(self, data: st.DataObject) -> None:
        counts = {
            s: data.draw(st.integers(1, 4))
            for s in sorted(data.draw(st.sets(st.integers(0, N - 1), min_size=1)))
        }
        fits = not self.mem.kv.unified or sum(counts.values()) <= 24 - len(self.kv)
        before = self.mem.state_write(-1)
        try:
            self.ctx.decode(Batch.from_sequences({s: [7] * n for s, n in counts.items()}))  # type: ignore[union-attr]
        except NoSlotError:
            assert not fits
            assert self.mem.state_write(-1) == before
            return
        assert fits
        for s, n in counts.items():
            start = self.pos_max(s) + 1
            self.kv += [(start + k, {s}) for k in range(n)]
            if s in self.cell and len([x for x in self.cell.values() if x == self.cell[s]]) == 1:
                self.cell_pos[self.cell[s]] = start + n - 1
            else:  # a new state, or copy-on-write of a shared one
                self.cell[s] = next(self.ids)
                self.cell_pos[self.cell[s]] = start + n - 1

    @rule(data=st.data())
    def seq_rm(self, data: st.DataObject) -> None:
        s = data.draw(st.integers(-1, N))
        p0, p1 = data.draw(st.integers(-1, 14)), data.draw(st.integers(-1, 16))
        lo, hi = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        before = self.mem.state_write(-1)
        if s >= N:
            refused = True
        elif s >= 0:
            P = self.rec_pos(s)
            refused = P >= 0 and 0 < lo <= P < hi
        else:
            refused = lo != hi and (lo != 0 or hi != POS_MAX)
        assert self.mem.seq_rm(s, p0, p1) is (not refused)
        if refused:
            assert self.mem.state_write(-1) == before
            return
        for q in [q for q in self.cell if (s < 0 or q == s) and lo <= self.rec_pos(q) < hi]:
            del self.cell[q]
        kept = []
        for p, seqs in self.kv:
            if lo <= p < hi and (s < 0 or s in seqs):
                seqs = set() if s < 0 else seqs - {s}
            if seqs:
                kept.append((p, seqs))
        self.kv = kept

    @rule(src=st.integers(0, N - 1), dst=st.integers(0, N - 1))
    def seq_cp(self, src: int, dst: int) -> None:
        self.mem.seq_cp(src, dst)
        if src == dst:
            return
        if self.mem.kv.unified:
            for _, seqs in self.kv:
                if src in seqs:
                    seqs.add(dst)
        else:
            self.kv = [(p, seqs) for p, seqs in self.kv if dst not in seqs]
            self.kv += [(p, {dst}) for p, seqs in self.kv if src in seqs]
        self.cell.pop(dst, None)
        if src in self.cell:
            self.cell[dst] = self.cell[src]

    @rule(s=st.integers(0, N - 1))
    def seq_keep(self, s: int) -> None:
        self.mem.seq_keep(s)
        self.cell = {q: c for q, c in self.cell.items() if q == s}
        self.kv = [(p, {s}) for p, seqs in self.kv if s in seqs]

    @rule(data=st.data())
    def seq_add(self, data: st.DataObject) -> None:
        s = data.draw(st.integers(0, N - 1))
        p0, p1, d = (
            data.draw(st.integers(-1, 12)),
            data.draw(st.integers(-1, 14)),
            data.draw(st.integers(-5, 5)),
        )
        lo, hi = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        if d == 0 or lo == hi:
            self.mem.seq_add(s, p0, p1, d)
            return
        P = self.rec_pos(s)
        if P >= 0 and lo <= P < hi and P + d < 0:
            before = self.mem.state_write(-1)
            with pytest.raises(ValueError):
                self.mem.seq_add(s, p0, p1, d)
            assert self.mem.state_write(-1) == before
            return
        self.mem.seq_add(s, p0, p1, d)
        if P >= 0 and lo <= P < hi:
            self.cell_pos[self.cell[s]] = P + d
        moved = []
        for p, seqs in self.kv:
            if lo <= p < hi and s in seqs:
                p += d
            if p >= 0:
                moved.append((p, seqs))
        self.kv = moved

    @invariant()
    def agrees(self) -> None:
        if self.ctx is None:
            return
        self.mem.check_invariants()
        for s in range(N):
            kv = self.kv_pos(s)
            assert self.mem.recurrent.seq_pos_max(s) == self.rec_pos(s)
            assert self.mem.kv.cells_of_seq(s).seq_pos.get(s, []) == kv
            assert self.mem.seq_pos_max(s) == min(max(kv, default=-1), self.rec_pos(s))
            assert self.mem.seq_pos_min(s) == max(min(kv, default=-1), self.rec_pos(s))


TestHybridMachine = HybridMachine.TestCase
TestHybridMachine.settings = settings(
    max_examples=40, stateful_step_count=20, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
