"""The engine over hybrid models (LFM2 and Nemotron-H from llama.cpp's fixture GGUFs): continuous batching,
n > 1 forks, sessions and slots through .ggsq files, the prefix cache of hybrid checkpoints (recurrent rows
plus the KV prefix), the per-sequence KV limit, and the snapshot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.engine import LLM, Engine, SamplingParams
from rsmem.engine.request import FinishReason
from rsmem.errors import InvalidRequestError, NoSlotError
from rsmem.memory import checkpoint
from rsmem.memory.hybrid import HybridMemory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
NAMES = ["lfm2", "nemotron_h"]
GREEDY = SamplingParams.greedy(max_tokens=6)
N_VOCAB = 300


@pytest.fixture(scope="module", params=NAMES)
def model(request):
    return rsmem.load_model(FIXTURES / request.param / "model-f32.gguf")


@pytest.fixture(scope="module")
def lfm2():
    return rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf")


def seq(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % N_VOCAB for k in range(n)]


def engine_for(model, n_seq_max: int = 4, **kw) -> Engine:
    ctx_kw = {k: kw.pop(k) for k in ("n_ctx", "kv_unified") if k in kw}
    ctx_kw.setdefault("n_ctx", 512 * n_seq_max)
    return Engine(Context(model, n_seq_max=n_seq_max, n_batch=64, n_ubatch=16, **ctx_kw), **kw)


def run(engine: Engine, prompt, params: SamplingParams = GREEDY, **kw):
    rid = engine.add_request(prompt, params, **kw)
    return next(o for o in engine.run_until_done() if o.finished and o.request_id == rid)


def alone(model, prompt, params: SamplingParams = GREEDY) -> tuple[int, ...]:
    return run(engine_for(model, n_seq_max=1), prompt, params).outputs[0].token_ids


# ------------------------------------------------------------- batching


def test_batched_requests_generate_what_each_generates_alone(model):
    engine = engine_for(model)
    prompts = [seq(1, 5), seq(2, 23), seq(3, 40), seq(4, 11)]
    ids = engine.add_requests(prompts, GREEDY)
    done = {o.request_id: o for o in engine.run_until_done() if o.finished}
    for rid, prompt in zip(ids, prompts, strict=True):
        assert done[rid].outputs[0].token_ids == alone(model, prompt)
        assert len(done[rid].outputs[0].token_ids) == 6
    snap = engine.snapshot()  # read the hybrid memory's cells (raised AttributeError before)
    assert snap.cells_total == 4 and 0 <= snap.cells_used <= 4


@pytest.mark.parametrize("unified", [False, True])
def test_n2_forks_continue_the_prompt(model, unified):
    engine = engine_for(model, n_seq_max=3, kv_unified=unified)
    out = run(engine, seq(5, 17), SamplingParams.greedy(max_tokens=5, n=2))
    expected = alone(model, seq(5, 17), SamplingParams.greedy(max_tokens=5))
    assert [c.token_ids for c in out.outputs] == [expected, expected]


# ----------------------------------------------------- sessions and slots


def test_a_saved_session_continues_in_a_new_engine(model, tmp_path):
    engine = engine_for(model, n_seq_max=2)
    s = engine.open_session()
    run(engine, seq(1, 9), session=s)
    engine.save_session(s, str(tmp_path / "s.ggsq"))
    second = run(engine, seq(7, 4), session=s)

    other = engine_for(model, n_seq_max=2)
    restored = other.open_session(str(tmp_path / "s.ggsq"))
    assert restored.tokens == s.tokens[: len(restored.tokens)]
    again = run(other, seq(7, 4), session=restored)
    assert again.outputs[0].token_ids == second.outputs[0].token_ids


def test_slot_save_and_restore_through_a_ggsq_file(model, tmp_path):
    engine = engine_for(model, n_seq_max=2, prompt_cache=True)
    prompt = seq(2, 20)
    first = run(engine, prompt, slot=1)
    n_tokens, n_bytes = engine.slot_save(1, str(tmp_path / "slot.ggsq"))
    assert n_tokens == len(prompt) + 5 and n_bytes > 0  # the last sampled token is not in the state
    follow = prompt + list(first.outputs[0].token_ids) + seq(9, 3)
    expected = alone(model, follow)

    other = engine_for(model, n_seq_max=2, prompt_cache=True)
    assert other.slot_restore(1, str(tmp_path / "slot.ggsq")) == n_tokens
    out = run(other, follow, slot=1)
    assert out.num_cached_tokens == n_tokens
    assert out.outputs[0].token_ids == expected


# -------------------------------------------------------- checkpoints


@pytest.mark.parametrize("unified", [False, True])
def test_a_restored_checkpoint_continues_as_a_fresh_sequence(model, unified):
    """A hybrid checkpoint restored into its own sequence (after it moved on) and into another one gives the
    logits of a fresh sequence fed the same tokens (1e-5) and the same greedy tokens."""
    prompt, rest = seq(1, 30), seq(11, 6)
    ctx = Context(model, n_seq_max=3, n_ctx=768, kv_unified=unified, n_ubatch=16)
    ctx.decode(Batch(prompt))
    ckpt = checkpoint.take(ctx.memory, 0)
    assert ckpt is not None and ckpt.kv is not None and ckpt.kv.positions == tuple(range(30))
    memory = ctx.memory
    assert isinstance(memory, HybridMemory)
    assert ckpt.nbytes == memory.state_bytes_per_seq() + 30 * memory.kv_bytes_per_token()
    ctx.decode(Batch(seq(50, 9), seq_ids=[[0]] * 9))  # seq 0 moves on
    fresh = Context(model, n_seq_max=1, n_ctx=256, n_ubatch=16)
    fresh.decode(Batch(prompt))
    for dest in (0, 2):
        checkpoint.restore(ctx.memory, ckpt, dest)
        assert ctx.memory.seq_pos_max(dest) == 29 and memory.kv.seq_pos_min(dest) == 0
    ctx.memory.check_invariants()
    for tok in rest:
        ctx.decode(Batch.from_sequences({0: [tok], 2: [tok]}))
        fresh.decode(Batch([tok], seq_ids=[[0]]))
        want = fresh.get_logits(-1)
        for i in (0, 1):
            got = ctx.get_logits(i)
            assert torch.allclose(got, want, atol=1e-5, rtol=0)
            assert int(got.argmax()) == int(want.argmax())


def test_a_checkpoint_restore_that_does_not_fit_changes_nothing(lfm2):
    ctx = Context(lfm2, n_seq_max=1, n_ctx=512, n_ubatch=16)
    ctx.decode(Batch(seq(1, 250)))
    big = checkpoint.take(ctx.memory, 0)
    assert big is not None and big.kv is not None and len(big.kv.positions) == 250
    tiny = Context(lfm2, n_seq_max=1, n_ctx=200, kv_unified=True, n_ubatch=16)  # 200 KV cells
    tiny.decode(Batch(seq(3, 10)))
    kept = tiny.state_seq_get_data(0)
    with pytest.raises(NoSlotError):
        checkpoint.restore(tiny.memory, big, 0)
    assert tiny.state_seq_get_data(0) == kept
    without_kv = checkpoint.Checkpoint(big.pos, "exact", big.r_rows, big.s_rows)
    with pytest.raises(ValueError, match="hybrid"):  # e.g. read from a file that holds recurrent rows only
        checkpoint.restore(tiny.memory, without_kv, 0)
    assert tiny.state_seq_get_data(0) == kept


def test_prefix_cache_serves_a_shared_prompt_with_the_same_tokens(model):
    engine = engine_for(model, n_seq_max=2, prompt_cache=True, cache_bytes=1 << 24, checkpoint_interval=8)
    system = seq(3, 40)
    first = run(engine, system + seq(60, 6))
    engine.add_request(seq(90, 12), GREEDY)  # another request takes over the sequence
    engine.add_request(seq(91, 12), GREEDY)
    list(engine.run_until_done())
    second = run(engine, system + seq(70, 5))
    assert second.num_cached_tokens >= 40  # the system prompt came from a checkpoint
    assert second.outputs[0].token_ids == alone(model, system + seq(70, 5))
    again = run(engine, system + seq(60, 6))  # a regenerate: one token computed
    assert again.num_cached_tokens == 45
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == alone(model, system + seq(60, 6))
    assert engine.snapshot().checkpoint_restores >= 2


# ------------------------------------------------------- the KV limit


def test_a_prompt_longer_than_a_sequences_kv_is_refused_before_it_runs(lfm2):
    engine = engine_for(lfm2, n_seq_max=2, n_ctx=512)  # 256 KV cells per sequence
    assert engine.ctx.max_seq_tokens == 256
    with pytest.raises(InvalidRequestError, match="max context of 256") as err:
        engine.add_request(seq(1, 257), GREEDY)
    assert err.value.param == "prompt"
    assert not engine.has_unfinished


def test_generation_ends_with_length_where_the_kv_is_full(lfm2):
    engine = engine_for(lfm2, n_seq_max=2, n_ctx=512)
    out = run(engine, seq(1, 250), SamplingParams.greedy(max_tokens=None, ignore_eos=True))
    assert out.error is None
    assert out.outputs[0].finish_reason is FinishReason.LENGTH
    assert len(out.outputs[0].token_ids) == 7  # 250 + 6 decoded = 256 positions, the 7th is sampled


def test_a_session_history_counts_toward_the_limit(lfm2):
    engine = engine_for(lfm2, n_seq_max=2, n_ctx=512)
    s = engine.open_session()
    run(engine, seq(1, 200), session=s)
    with pytest.raises(InvalidRequestError, match="session's history"):
        engine.add_request(seq(2, 60), GREEDY, session=s)


def test_a_session_that_fills_the_kv_ends_with_length_and_saves(lfm2, tmp_path):
    """Issue 37 (4): the session's last sampled token, decoded by the save, found no cell."""
    engine = engine_for(lfm2, n_seq_max=2, n_ctx=512)
    s = engine.open_session()
    out = run(engine, seq(1, 250), SamplingParams.greedy(max_tokens=None, ignore_eos=True), session=s)
    assert out.outputs[0].finish_reason is FinishReason.LENGTH
    assert len(out.outputs[0].token_ids) == 6  # the 6th waits for a cell of its own: the 256th
    engine.save_session(s, str(tmp_path / "s.ggsq"))
    assert len(s.tokens) == 256 and not s.pending
    with pytest.raises(InvalidRequestError, match="less one for the reply"):
        engine.add_request(seq(2, 1), GREEDY, session=s)


def test_llm_sizes_the_kv_for_its_sequences(lfm2):
    llm = LLM(lfm2, n_seq_max=8)  # default: 8 x 4096 cells, 4096 a sequence
    assert llm.context.max_seq_tokens == 4096
    out = llm.generate([seq(1, 600)], SamplingParams.greedy(max_tokens=2))  # NoSlotError before (512 each)
    assert len(out[0].outputs[0].token_ids) == 2
    assert LLM(lfm2, n_seq_max=2, n_ctx=1000).context.max_seq_tokens == 512
    assert LLM(lfm2, n_seq_max=2, n_ctx=1000, kv_unified=True).context.max_seq_tokens == 1000
    with pytest.raises(ValueError, match="n_ctx"):
        LLM(lfm2, n_ctx=0)


def test_a_kept_state_rolls_back_for_a_turn_parting_near_its_end(model):
    """``n_rs_seq``: the recurrent part replays, the KV part is cut by position."""
    engine = Engine(
        Context(model, n_seq_max=1, n_batch=64, n_ubatch=16, n_ctx=512, n_rs_seq=4), prompt_cache=True
    )
    prompt = seq(1, 20)
    first = run(engine, prompt).outputs[0].token_ids  # the sequence keeps prompt + first[:-1]
    follow = prompt + list(first[:3]) + [(first[3] + 1) % N_VOCAB, 9] + seq(5, 6)
    out = run(engine, follow)
    assert out.num_cached_tokens == len(prompt) + 3
    assert engine.snapshot().cache_hits_rollback == 1
    assert out.outputs[0].token_ids == alone(model, follow)
