"""The attention KV cache against llama.cpp's rules (``llama-kv-cache.cpp``, ``llama-kv-cells.h``).

A hypothesis state machine runs random decodes and sequence operations on a cache and on a plain model of
it: a list of stored tokens, each a position and the set of sequences that see it (a cell, abstractly),
every operation written from llama.cpp's semantics. After each step every sequence's positions, the used
cell count and the causal masks of the last decode must agree, and ``prepare`` must change nothing.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from rsmem import Batch, BatchAllocator
from rsmem.errors import UnknownSequenceError
from rsmem.memory.context import MemoryStatus
from rsmem.memory.kv_cache import KVCache
from rsmem.memory.kv_cells import KVCells

N_SEQ = 3
SIZE = 12


def decode(cache: KVCache, tokens_by_seq: dict[int, int], n_ubatch: int = 4) -> list[torch.Tensor] | None:
    """Place one batch (``n`` tokens per sequence, positions auto-filled); the masks of each micro-batch,
    or None when it did not fit (FAILED_PREPARE)."""
    balloc = BatchAllocator()
    batch = Batch.from_sequences({s: [1] * n for s, n in tokens_by_seq.items()})
    balloc.init(batch, n_vocab=4, n_seq_max=cache.n_seq_max, memory=cache)
    mctx = cache.init_batch(balloc, n_ubatch)
    if mctx.status is not MemoryStatus.SUCCESS:
        return None
    masks = []
    while True:
        mctx.apply()
        masks.append((mctx.ubatch, mctx.sinfo, mctx.mask().clone()))
        if not mctx.next():
            break
    return masks


class KVMachine(RuleBasedStateMachine):
    """``unified`` is drawn per run: one shared stream, or a stream of SIZE cells per sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: KVCache | None = None
        self.cells: list[tuple[int, set[int]]] = []  # the plain model: (pos, seqs) per stored token
        self.last_masks: list = []

    @initialize(unified=st.booleans())
    def start(self, unified: bool) -> None:
        self.cache = KVCache({0: (4, 4)}, SIZE, N_SEQ, unified=unified)

    def positions(self, seq: int) -> list[int]:
        return sorted(p for p, seqs in self.cells if seq in seqs)

    def free(self, seq: int) -> int:
        """Cells free for ``seq``: its own stream, or the one shared stream."""
        if self.cache is not None and self.cache.unified:
            return SIZE - len(self.cells)
        return SIZE - sum(1 for _, seqs in self.cells if seq in seqs)

    @rule(data=st.data())
    def do_decode(self, data: st.DataObject) -> None:
        if self.cache is None:
            return
        seqs = data.draw(st.sets(st.integers(0, N_SEQ - 1), min_size=1), label="seqs")
        counts = {s: data.draw(st.integers(1, 5), label=f"n{s}") for s in sorted(seqs)}
        fits = (
            sum(counts.values()) <= SIZE - len(self.cells)
            if self.cache.unified
            else all(n <= self.free(s) for s, n in counts.items())
        )
        before = [(c.pos[:], [set(x) for x in c.seqs]) for c in self.cache.streams]
        masks = decode(self.cache, counts)
        if masks is None:
            assert not fits
            assert [(c.pos, c.seqs) for c in self.cache.streams] == before  # nothing changed
            return
        assert fits
        for s, n in counts.items():
            start = max(self.positions(s), default=-1) + 1
            self.cells += [(start + k, {s}) for k in range(n)]
        self.last_masks = masks

    @rule(data=st.data())
    def do_seq_rm(self, data: st.DataObject) -> None:
        if self.cache is None:
            return
        seq = data.draw(st.integers(-1, N_SEQ), label="seq")
        p0, p1 = data.draw(st.integers(-1, 12)), data.draw(st.integers(-1, 14))
        assert self.cache.seq_rm(seq, p0, p1) is (seq < N_SEQ)
        lo, hi = max(p0, 0), (2**31 - 1 if p1 < 0 else p1)
        if seq >= N_SEQ:
            return
        kept = []
        for p, seqs in self.cells:
            if lo <= p < hi and (seq < 0 or seq in seqs):
                seqs = set() if seq < 0 else seqs - {seq}
            if seqs:
                kept.append((p, seqs))
        self.cells = kept
        self.last_masks = []

    @rule(data=st.data())
    def do_seq_cp(self, data: st.DataObject) -> None:
        if self.cache is None:
            return
        src, dst = data.draw(st.integers(0, N_SEQ - 1)), data.draw(st.integers(0, N_SEQ - 1))
        if self.cache.unified:
            p0, p1 = data.draw(st.integers(-1, 10)), data.draw(st.integers(-1, 12))
            self.cache.seq_cp(src, dst, p0, p1)
            lo, hi = max(p0, 0), (2**31 - 1 if p1 < 0 else p1)
            for p, seqs in self.cells:
                if lo <= p < hi and src in seqs:
                    seqs.add(dst)
        else:
            with pytest.raises(ValueError) if src != dst else _nothing():
                self.cache.seq_cp(src, dst, 2, 5)  # streams copy only whole sequences
            self.cache.seq_cp(src, dst)
            if src != dst:
                self.cells = [(p, seqs) for p, seqs in self.cells if dst not in seqs]
                self.cells += [(p, {dst}) for p, seqs in self.cells if src in seqs]
        self.last_masks = []

    @rule(seq=st.integers(0, N_SEQ - 1))
    def do_seq_keep(self, seq: int) -> None:
        if self.cache is None:
            return
        self.cache.seq_keep(seq)
        self.cells = [(p, {seq}) for p, seqs in self.cells if seq in seqs]
        self.last_masks = []

    @rule(data=st.data(), divide=st.booleans())
    def do_seq_move(self, data: st.DataObject, divide: bool) -> None:
        if self.cache is None:
            return
        seq = data.draw(st.integers(0, N_SEQ - 1))
        p0, p1 = data.draw(st.integers(-1, 10)), data.draw(st.integers(-1, 12))
        lo, hi = max(p0, 0), (2**31 - 1 if p1 < 0 else p1)
        d = data.draw(st.integers(1, 3) if divide else st.integers(-6, 6), label="d")
        (self.cache.seq_div if divide else self.cache.seq_add)(seq, p0, p1, d)
        moved = []
        for p, seqs in self.cells:
            if lo <= p < hi and seq in seqs and not (divide and d == 1) and (divide or d != 0):
                p = p // d if divide else p + d  # every sequence on the cell moves with it
            if p >= 0:
                moved.append((p, seqs))
        self.cells = moved
        self.last_masks = []

    @rule(seq=st.sampled_from([-1, N_SEQ]))
    def unknown_sequence(self, seq: int) -> None:
        if self.cache is None:
            return
        for op in (lambda: self.cache.seq_keep(seq), lambda: self.cache.seq_pos_max(seq)):
            with pytest.raises(UnknownSequenceError):
                op()

    @invariant()
    def agrees(self) -> None:
        if self.cache is None:
            return
        self.cache.check_invariants()
        assert sum(c.n_used for c in self.cache.streams) == len(self.cells)
        for s in range(N_SEQ):
            pos = self.positions(s)
            assert self.cache.cells_of_seq(s).seq_pos.get(s, []) == pos
            assert self.cache.seq_pos_min(s) == (pos[0] if pos else -1)
            assert self.cache.seq_pos_max(s) == (pos[-1] if pos else -1)

    @invariant()
    def masks_are_causal_per_sequence(self) -> None:
        """Each decoded token saw exactly its sequence's positions up to its own, itself included."""
        if self.cache is None:
            return
        for ub, sinfo, mask in self.last_masks:
            n = sinfo.n_per_group
            for g, (st_, _) in enumerate(sinfo.groups):
                cells = self.cache.streams[st_]
                for k in range(n):
                    t = g * n + k
                    seq, p = ub.seq_ids[t][0], ub.pos[t]
                    seen = sorted(cells.pos[j] for j in range(mask.shape[-1]) if mask[g, k, j])
                    assert seen == [q for q in self.positions(seq) if q <= p]
                    assert p in seen


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return False


TestKVMachine = pytest.mark.fuzz(KVMachine.TestCase)
TestKVMachine.settings = settings(
    max_examples=150, stateful_step_count=25, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_prepare_leaves_the_cells_as_they_were() -> None:
    cache = KVCache({0: (2, 2)}, 8, 2, unified=True)
    assert decode(cache, {0: 3}) is not None
    before = cache.streams[0].copy(), list(cache.heads)
    balloc = BatchAllocator()
    balloc.init(Batch.from_sequences({0: [1] * 2, 1: [1] * 2}), n_vocab=4, n_seq_max=2, memory=cache)
    ub = balloc.split_simple(8)
    assert ub is not None
    assert cache.prepare([ub]) is not None
    assert cache.streams[0] == before[0] and cache.heads == before[1]
    assert cache.prepare([ub, ub, ub]) is None  # 3 + 12 tokens do not fit in 8 cells
    assert cache.streams[0] == before[0] and cache.heads == before[1]


def test_slots_are_the_first_empty_cells_from_the_head() -> None:
    """llama.cpp's non-contiguous search: holes left by seq_rm are reused, in circular order from the
    head (which seq_rm moves back to the first freed cell)."""
    cache = KVCache({0: (2, 2)}, 8, 2, unified=True)
    decode(cache, {0: 3, 1: 3})
    assert cache.heads == [6]
    cache.seq_rm(0, 1, 2)  # frees the cell of seq 0's position 1
    assert cache.heads[0] == cache.streams[0].pos.index(-1)
    masks = decode(cache, {1: 3})
    assert masks is not None
    _, sinfo, _ = masks[0]
    assert sinfo.groups[0][1] == [1, 6, 7]


def test_k_shift_is_applied_before_the_next_step() -> None:
    cache = KVCache({0: (2, 2)}, 8, 1, unified=True)
    calls = []
    cache.set_k_shift(lambda il, rows, delta: calls.append(delta.tolist()) or rows + delta[:, None])
    decode(cache, {0: 4})
    cache.seq_add(0, 2, -1, 3)
    assert cache.seq_pos_max(0) == 6 and cache.has_shift()
    cache.update()
    assert calls == [[3, 3]] and not cache.has_shift()
    assert cache.k_l[0][0, 2:4].tolist() == [[3.0, 3.0], [3.0, 3.0]]


def test_attention_matches_a_plain_causal_softmax() -> None:
    torch.manual_seed(0)
    cache = KVCache({0: (2 * 4, 2 * 4)}, 16, 2, unified=True)
    balloc = BatchAllocator()
    balloc.init(Batch.from_sequences({0: [1] * 3, 1: [1] * 2}), n_vocab=4, n_seq_max=2, memory=cache)
    mctx = cache.init_batch(balloc, 8)
    mctx.apply()
    q, k, v = torch.randn(5, 4, 4), torch.randn(5, 2, 4), torch.randn(5, 2, 4)
    out = mctx.attention(0, q, k, v, 0.5).view(5, 4, 4)
    for t, lo in enumerate([0, 0, 0, 3, 3]):
        keys = range(lo, t + 1)
        for h in range(4):
            kv = h // 2
            w = torch.softmax(torch.stack([q[t, h] @ k[j, kv] * 0.5 for j in keys]), 0)
            want = sum(w[i] * v[j, kv] for i, j in enumerate(keys))
            torch.testing.assert_close(out[t, h], want)


def test_masks_beyond_62_sequences() -> None:
    """Bit masks hold 62 sequences; ids above use the sets (same masks)."""
    cache = KVCache({0: (2, 2)}, 16, 70, unified=True)
    masks = decode(cache, {3: 2, 65: 3, 69: 1})
    assert masks is not None
    ub, _, mask = masks[0]
    for t in range(ub.n_tokens):
        seq, p = ub.seq_ids[t][0], ub.pos[t]
        cells = cache.streams[0]
        seen = sorted(cells.pos[j] for j in range(mask.shape[-1]) if mask[0, t, j] and seq in cells.seqs[j])
        assert int(mask[0, t].sum()) == len(seen) == p + 1
    cache.check_invariants()


def test_used_max_p1_follows_occupy_and_removal() -> None:
    """The scan starts at ``hi`` (an upper bound kept by occupy), and stays exact as cells empty."""
    cells = KVCells(4096)
    assert cells.used_max_p1() == 0
    cells.occupy(5, 0, {0})
    cells.occupy(2, 1, {0})
    assert cells.used_max_p1() == 6 and cells.hi == 6
    cells.rm(5)
    assert cells.used_max_p1() == 3
    cells.occupy(4000, 2, {1})
    assert cells.used_max_p1() == 4001
    copy = cells.copy()
    cells.seq_rm(4000, 1)
    cells.rm(2)
    assert cells.used_max_p1() == 0 and copy.used_max_p1() == 4001
    cells.check()
