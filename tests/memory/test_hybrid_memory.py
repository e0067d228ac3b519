"""The hybrid memory's sequence operations (llama-memory-hybrid.cpp) on LFM2: llama.cpp's combined results,
nothing changed where a part refuses, forks and position shifts checked against fresh contexts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.errors import NoSlotError, UnknownSequenceError
from rsmem.memory.hybrid import HybridMemory, kv_size_for

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "lfm2"
PROMPT = json.loads((FIXTURES / "fixture.json").read_text())["prompt"]


@pytest.fixture(scope="module")
def model():
    return rsmem.load_model(FIXTURES / "model-f32.gguf")


def _ctx(model, unified: bool = False, n_seq_max: int = 3) -> Context:
    return Context(model, n_seq_max=n_seq_max, n_ctx=256 * n_seq_max, kv_unified=unified)


def _mem(ctx: Context) -> HybridMemory:
    assert isinstance(ctx.memory, HybridMemory)
    return ctx.memory


def _continue(ctx: Context, seq: int, tokens: list[int], start: int | None = None) -> torch.Tensor:
    pos = None if start is None else list(range(start, start + len(tokens)))
    ctx.decode(Batch(tokens, pos=pos, seq_ids=[[seq]] * len(tokens), logits=[True] * len(tokens)))
    return ctx.logits.clone()


def test_kv_size_is_llamacpps() -> None:
    assert kv_size_for(512, 2, False) == 256
    assert kv_size_for(1000, 3, False) == 512  # 333 rounded up to 256s
    assert kv_size_for(1000, 3, True) == 1000


@pytest.mark.parametrize("unified", [False, True])
def test_seq_rm_is_refused_where_the_recurrent_state_cannot_be_cut(model, unified: bool) -> None:
    ctx = _ctx(model, unified)
    mem = _mem(ctx)
    ctx.decode(Batch(PROMPT))
    before = mem.state_write(-1)
    assert mem.seq_rm(0, 5, -1) is False  # would cut the state at 11
    assert mem.seq_rm(0, 3, 12) is False
    assert mem.seq_rm(-1, 0, 3) is False
    assert mem.state_write(-1) == before
    assert mem.seq_rm(0, 12, -1) is True  # nothing at or after 12: a no-op
    assert mem.seq_pos_max(0) == 11
    # llama.cpp: a range ending before the state's position is a no-op for the recurrent part, and the
    # attention part drops those positions
    assert mem.seq_rm(0, 0, 5) is True
    assert mem.kv.seq_pos_min(0) == 5 and mem.recurrent.seq_pos_max(0) == 11
    assert mem.seq_pos_min(0) == 11 and mem.seq_pos_max(0) == 11
    assert mem.seq_rm(0, -1, -1) is True
    assert mem.seq_pos_max(0) == -1 and mem.kv.seq_pos_max(0) == -1
    assert mem.seq_rm(3, -1, -1) is False  # no such sequence
    mem.check_invariants()


@pytest.mark.parametrize("unified", [False, True])
def test_fork_continues_like_a_fresh_sequence(model, unified: bool) -> None:
    ctx = _ctx(model, unified)
    ctx.decode(Batch(PROMPT))
    _mem(ctx).seq_cp(0, 2)
    if unified:  # one stream: the fork shares the prompt's cells
        cells = _mem(ctx).kv.streams[0]
        assert sum(1 for s in cells.seqs if s == {0, 2}) == len(PROMPT)
    got_a = _continue(ctx, 2, [11, 12])
    got_b = _continue(ctx, 0, [40, 41, 42])
    _mem(ctx).check_invariants()
    for tail, got in (([11, 12], got_a), ([40, 41, 42], got_b)):
        fresh = _ctx(model, unified)
        fresh.decode(Batch(PROMPT + tail, logits=[False] * len(PROMPT) + [True] * len(tail)))
        torch.testing.assert_close(got, fresh.logits, atol=2e-5, rtol=0)


def test_cross_stream_partial_copy_is_refused_unchanged(model) -> None:
    ctx = _ctx(model, unified=False)
    ctx.decode(Batch(PROMPT))
    before = _mem(ctx).state_write(-1)
    with pytest.raises(ValueError):
        _mem(ctx).seq_cp(0, 1, 2, 6)
    assert _mem(ctx).state_write(-1) == before
    with pytest.raises(UnknownSequenceError):
        _mem(ctx).seq_cp(0, 5)


@pytest.mark.parametrize("unified", [False, True])
def test_seq_keep_drops_the_others_in_both_parts(model, unified: bool) -> None:
    ctx = _ctx(model, unified)
    ctx.decode(Batch.from_sequences({0: PROMPT[:4], 1: PROMPT[:6], 2: PROMPT[:3]}))
    _mem(ctx).seq_keep(1)
    assert [_mem(ctx).seq_pos_max(s) for s in range(3)] == [-1, 5, -1]
    assert [_mem(ctx).kv.seq_pos_max(s) for s in range(3)] == [-1, 5, -1]
    _mem(ctx).check_invariants()


@pytest.mark.parametrize("unified", [False, True])
def test_seq_add_shifts_keys_by_rope(model, unified: bool) -> None:
    """Moving every position by 3 re-rotates the stored keys: the continuation equals a sequence whose
    prompt was decoded at positions 3.. (the conv layers do not see positions)."""
    ctx = _ctx(model, unified)
    ctx.decode(Batch(PROMPT))
    _mem(ctx).seq_add(0, -1, -1, 3)
    assert _mem(ctx).seq_pos_max(0) == 14 and _mem(ctx).kv.has_shift()
    got = _continue(ctx, 0, [11, 12])
    assert not _mem(ctx).kv.has_shift()
    fresh = _ctx(model, unified)
    fresh.decode(Batch(PROMPT, pos=list(range(3, 15))))
    torch.testing.assert_close(got, _continue(fresh, 0, [11, 12]), atol=2e-5, rtol=0)
    plain = _ctx(model, unified)
    plain.decode(Batch(PROMPT))
    assert (got - _continue(plain, 0, [11, 12])).abs().max() < 2e-5  # relative positions: the same logits


def test_seq_add_below_zero_is_refused_unchanged(model) -> None:
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    before = _mem(ctx).state_write(-1)
    with pytest.raises(ValueError):
        _mem(ctx).seq_add(0, -1, -1, -20)
    assert _mem(ctx).state_write(-1) == before


def test_a_full_stream_refuses_the_batch_unchanged(model) -> None:
    ctx = Context(model, n_seq_max=1, n_ctx=16, kv_unified=True)
    ctx.decode(Batch(PROMPT))
    before = _mem(ctx).state_write(-1)
    with pytest.raises(NoSlotError):
        ctx.decode(Batch([1] * 5))
    assert _mem(ctx).state_write(-1) == before
    ctx.decode(Batch([1] * 4))  # exactly fills the 16 cells
    assert _mem(ctx).seq_pos_max(0) == 15


def test_rollback_cuts_both_parts_and_refuses_deeper_cuts_unchanged(model) -> None:
    ctx = Context(model, n_seq_max=2, n_ctx=512, n_rs_seq=4)
    mem = _mem(ctx)
    assert mem.n_rs_seq == 4 and mem.rollback is not None
    ctx.decode(Batch(PROMPT))
    mem.seq_cp(0, 1)
    before = mem.state_write(-1)
    assert mem.seq_rm(1, 7, -1) is False  # 5 positions: deeper than the window
    assert mem.state_write(-1) == before
    assert mem.seq_rm(1, 9, -1) is True
    assert (mem.recurrent.seq_pos_max(1), mem.kv.seq_pos_max(1), mem.seq_pos_max(0)) == (8, 8, 11)
    got = _continue(ctx, 1, [50, 51])
    fresh = _ctx(model)
    fresh.decode(Batch([*PROMPT[:9], 50, 51], logits=[False] * 9 + [True, True]))
    torch.testing.assert_close(got, fresh.logits, atol=2e-5, rtol=0)
    mem.check_invariants()


@pytest.mark.parametrize("unified", [False, True])
def test_a_placed_micro_batch_runs_in_column_slices(model, unified: bool) -> None:
    """A Context may run a placed micro-batch as column slices (rsmem.memory.capture.column_slices): the
    attention of each slice stores its own tokens and sees the earlier ones; logits equal the whole run."""
    from rsmem.batch.allocator import BatchAllocator
    from rsmem.memory.capture import column_slices

    batch = Batch.from_sequences({0: PROMPT, 2: PROMPT[::-1]}, all_logits=True)
    whole = _ctx(model, unified)
    whole.decode(batch)
    ctx = _ctx(model, unified)
    balloc = BatchAllocator()
    balloc.init(batch, n_vocab=model.n_vocab, n_seq_max=3, memory=ctx.memory)
    mctx = _mem(ctx).init_batch(balloc, 512)
    mctx.apply()
    got = torch.empty_like(whole.logits)
    with torch.inference_mode():
        for part in column_slices(mctx.ubatch, [2, 7]):
            rows = [part.batch_index[i] for i in part.output_rows()]
            got[rows] = model.forward(part, mctx)
    assert not mctx.next()
    torch.testing.assert_close(got, whole.logits, atol=2e-5, rtol=0)
