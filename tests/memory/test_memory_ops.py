"""Sequence operations of RecurrentMemory: every row of SPEC section 1, with llama.cpp's return values."""

from __future__ import annotations

import pytest
import torch

from helpers.memory import decode_seq, small_memory, snapshot, toy_context
from rsmem import BatchAllocator, MemoryStatus, UnknownSequenceError
from rsmem.memory.recurrent import RecurrentMemory, StateShape


@pytest.fixture
def ctx_at_pos9():
    """A Mamba-like setting: sequence 0 decoded up to position 9 (ten tokens)."""
    model, ctx = toy_context(n_seq_max=4)
    decode_seq(ctx, 0, list(range(10)))
    assert ctx.memory.seq_pos_max(0) == 9
    return ctx


# ---------------------------------------------------------------- seq_rm


@pytest.mark.parametrize(
    ("seq", "p0", "p1", "expected", "removed"),
    [
        (0, 0, 5, True, False),  # ends before the tail: a no-op that succeeds
        (0, 3, 12, False, False),  # would cut the state
        (0, 9, -1, False, False),  # would cut the state at its last position
        (0, 10, -1, True, False),  # starts after the tail: a no-op
        (0, 0, 10, True, True),  # covers the tail: the sequence is gone
        (-1, 0, 3, False, False),  # all sequences, partial range
        (7, -1, -1, False, False),  # seq id beyond n_seq_max = 4
        (0, -1, -1, True, True),
        (-1, -1, -1, True, True),
        (1, -1, -1, True, False),  # another, empty sequence
        (0, 3, 5, True, False),  # partial range before the tail
    ],
)
def test_seq_rm_matches_llamacpp(ctx_at_pos9, seq, p0, p1, expected, removed):
    mem = ctx_at_pos9.memory
    assert mem.seq_rm(seq, p0, p1) is expected
    assert mem.seq_pos_max(0) == (-1 if removed else 9)
    assert mem.used == (0 if removed else 1)
    mem.check_invariants()


def test_seq_rm_of_shared_cell_keeps_the_other_sequence(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    mem.seq_cp(0, 1)
    assert mem.used == 1
    assert mem.seq_rm(0, -1, -1)
    assert mem.seq_pos_max(0) == -1
    assert mem.seq_pos_max(1) == 9
    assert mem.used == 1
    mem.check_invariants()


def test_seq_rm_frees_cell_and_moves_head_back():
    model, ctx = toy_context(n_seq_max=4)
    for seq in range(3):
        decode_seq(ctx, seq, [1, 2])
    mem = ctx.memory
    cell = mem.cells.tail[0]
    assert mem.seq_rm(0, -1, -1)
    assert mem.cells.is_empty(cell)
    assert mem.head <= cell
    assert mem.used == 2


# ---------------------------------------------------------------- seq_cp


def test_seq_cp_shares_the_cell_without_copying(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    before = snapshot(mem)
    mem.seq_cp(0, 2, 0, 3)  # the range is ignored
    assert mem.cells.tail[2] == mem.cells.tail[0]
    assert mem.seq_pos_max(2) == 9
    assert mem.used == 1
    for a, b in zip(before.rows, snapshot(mem).rows):
        assert torch.equal(a, b)
    mem.check_invariants()


def test_seq_cp_releases_the_destination_first(ctx_at_pos9):
    ctx = ctx_at_pos9
    decode_seq(ctx, 1, [3, 4])
    mem = ctx.memory
    assert mem.used == 2
    mem.seq_cp(0, 1)
    assert mem.used == 1
    assert mem.seq_pos_max(1) == 9
    mem.check_invariants()


def test_seq_cp_from_empty_sequence_empties_destination(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    mem.seq_cp(3, 0)
    assert mem.seq_pos_max(0) == -1
    assert mem.used == 0


def test_seq_cp_same_sequence_is_noop(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    before = snapshot(mem)
    mem.seq_cp(0, 0)
    before.assert_same(snapshot(mem))


@pytest.mark.parametrize(("src", "dst"), [(0, 4), (4, 0), (-1, 0), (0, -2)])
def test_seq_cp_rejects_unknown_sequences(ctx_at_pos9, src, dst):
    mem = ctx_at_pos9.memory
    before = snapshot(mem)
    with pytest.raises(UnknownSequenceError, match="seq_id"):
        mem.seq_cp(src, dst)
    before.assert_same(snapshot(mem))


# --------------------------------------------------------------- seq_keep


def test_seq_keep_drops_every_other_sequence():
    model, ctx = toy_context(n_seq_max=4)
    for seq in range(3):
        decode_seq(ctx, seq, [1, 2, 3])
    mem = ctx.memory
    mem.seq_cp(1, 3)
    mem.seq_keep(1)
    assert [mem.seq_pos_max(s) for s in range(4)] == [-1, 2, -1, -1]
    assert mem.used == 1
    assert mem.cells.seqs[mem.cells.tail[1]] == {1}
    mem.check_invariants()


# ------------------------------------------------------- seq_add / seq_div


def test_seq_add_moves_only_the_tail_position_in_range(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    rows = snapshot(mem).rows
    mem.seq_add(0, 0, 5, 100)  # tail at 9 is outside [0, 5)
    assert mem.seq_pos_max(0) == 9
    mem.seq_add(0, 5, -1, 3)
    assert mem.seq_pos_max(0) == 12
    assert mem.seq_pos_min(0) == 12
    for a, b in zip(rows, snapshot(mem).rows):
        assert torch.equal(a, b)
    mem.seq_add(0, 0, -1, -12)
    assert mem.seq_pos_max(0) == 0


def test_seq_add_refuses_negative_positions(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    with pytest.raises(ValueError, match="below zero"):
        mem.seq_add(0, -1, -1, -10)
    assert mem.seq_pos_max(0) == 9


def test_seq_div_divides_tail_position(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    mem.seq_div(0, 0, 9, 2)  # 9 not in [0, 9)
    assert mem.seq_pos_max(0) == 9
    mem.seq_div(0, 0, -1, 2)
    assert mem.seq_pos_max(0) == 4
    with pytest.raises(ValueError, match="divisor"):
        mem.seq_div(0, 0, -1, 0)


def test_seq_add_on_shared_cell_moves_all_sharers(ctx_at_pos9):
    # llama.cpp moves the tail cell's pos; every sequence sharing it sees the move.
    mem = ctx_at_pos9.memory
    mem.seq_cp(0, 1)
    mem.seq_add(1, -1, -1, 1)
    assert mem.seq_pos_max(0) == mem.seq_pos_max(1) == 10


# ----------------------------------------------------- pos queries, clear


def test_pos_queries_of_empty_and_unknown_sequences():
    mem = small_memory()
    assert mem.seq_pos_min(0) == -1 and mem.seq_pos_max(3) == -1
    with pytest.raises(UnknownSequenceError):
        mem.seq_pos_max(4)


def test_clear_with_and_without_data(ctx_at_pos9):
    mem = ctx_at_pos9.memory
    row = mem.cells.tail[0]
    assert mem.s_l[0][row].abs().sum() > 0
    mem.clear(data=False)
    assert mem.used == 0 and mem.seq_pos_max(0) == -1
    assert mem.s_l[0][row].abs().sum() > 0
    mem.clear(data=True)
    assert all(t.abs().sum() == 0 for t in (*mem.r_l, *mem.s_l))


# --------------------------------------------------------------- find_slot


def _ubatch(balloc_tokens: dict[int, list[int]], mem: RecurrentMemory, n_ubatch: int = 64):
    from rsmem import Batch

    balloc = BatchAllocator()
    balloc.init(Batch.from_sequences(balloc_tokens), n_vocab=100, n_seq_max=mem.size, memory=mem)
    return balloc.split_equal(n_ubatch)


def test_find_slot_new_sequences_read_the_zero_row():
    mem = small_memory(4)
    ub = _ubatch({0: [1, 2], 2: [3, 4]}, mem)
    assert mem.find_slot(ub)
    assert (mem.head, mem.n) == (0, 2)
    assert mem.rs_z == 0
    assert [mem.cells.src0[c] for c in range(2)] == [0, 0]
    assert mem.cells.tail[0] == 0 and mem.cells.tail[2] == 1
    assert mem.seq_pos_max(0) == 1 and mem.seq_pos_max(2) == 1
    mem.check_invariants()


def test_find_slot_copies_a_shared_cell_on_write():
    mem = small_memory(4)
    assert mem.find_slot(_ubatch({0: [1]}, mem))
    mem.seq_cp(0, 1)
    assert mem.find_slot(_ubatch({1: [2]}, mem))
    c0, c1 = mem.cells.tail[0], mem.cells.tail[1]
    assert c0 != c1
    assert mem.cells.src0[c1] == c0  # the new cell reads the shared row
    assert mem.seq_pos_max(0) == 0 and mem.seq_pos_max(1) == 1
    assert mem.used == 2
    mem.check_invariants()


def test_find_slot_reorders_cells_contiguously_in_ubatch_order():
    mem = small_memory(4)
    for seq in (0, 1, 2, 3):
        assert mem.find_slot(_ubatch({seq: [1]}, mem))
    # cells are 0,1,2,3 for seqs 0,1,2,3; a ubatch with seqs 3 and 0 needs them adjacent
    assert mem.find_slot(_ubatch({3: [5], 0: [5]}, mem))
    assert (mem.cells.tail[3], mem.cells.tail[0]) == (mem.head, mem.head + 1)
    # each cell's src0 names the row its data sat in before the swap
    assert mem.cells.src0[mem.head] == 3
    assert mem.cells.src0[mem.head + 1] == 0
    # cells swapped out of place sit in [head+n_seqs, head+n) and read their old rows too
    assert mem.n == 4
    assert sorted(mem.cells.src0[mem.head : mem.head + mem.n]) == [0, 1, 2, 3]
    mem.check_invariants()


def test_prepare_is_a_dry_run():
    model, ctx = toy_context(n_seq_max=4)
    decode_seq(ctx, 0, [1, 2])
    mem = ctx.memory
    mem.seq_cp(0, 1)
    before = snapshot(mem)
    balloc = BatchAllocator()
    from rsmem import Batch

    balloc.init(Batch.from_sequences({1: [3], 2: [4, 5]}), n_vocab=32, n_seq_max=4, memory=mem)
    mctx = mem.init_batch(balloc, n_ubatch=8)
    assert mctx.status is MemoryStatus.SUCCESS
    assert len(mctx.ubatches) == 2  # seq 2 has more tokens: equal split needs a second ubatch
    before.assert_same(snapshot(mem))


def test_memory_context_exposes_placement():
    mem = small_memory(4)
    from rsmem import Batch

    balloc = BatchAllocator()
    balloc.init(Batch.from_sequences({1: [1, 2], 3: [3, 4]}), n_vocab=10, n_seq_max=4, memory=mem)
    mctx = mem.init_batch(balloc, n_ubatch=8)
    assert mctx.apply()
    assert mctx.ubatch.n_seqs == 2 and mctx.ubatch.n_seq_tokens == 2
    assert (mctx.head, mctx.n_rs, mctx.rs_z) == (0, 2, 0)
    assert [mctx.s_copy(i) for i in range(2)] == [0, 0]
    assert mctx.next() is False


def test_init_full_and_init_update():
    mem = small_memory(3)
    full = mem.init_full()
    assert full.status is MemoryStatus.SUCCESS
    assert (full.head, full.n_rs, full.rs_z, full.size) == (0, 3, 0, 3)
    upd = mem.init_update()
    assert upd.status is MemoryStatus.NO_UPDATE
    assert upd.apply()


def test_layer_filter_skips_layers():
    mem = RecurrentMemory(StateShape(4, 2, 3), 2, layer_filter=lambda il: il % 2 == 1)
    assert [t is None for t in mem.r_l] == [True, False, True, False]
    assert mem.total_size() == 2 * 2 * (2 + 3) * 4


def test_state_dtypes():
    for dtype in (torch.float16, torch.bfloat16):
        mem = RecurrentMemory(StateShape(1, 2, 3), 2, dtype=dtype)
        assert mem.r_l[0].dtype == dtype
    with pytest.raises(ValueError, match="dtype"):
        RecurrentMemory(StateShape(1, 2, 3), 2, dtype=torch.int32)
