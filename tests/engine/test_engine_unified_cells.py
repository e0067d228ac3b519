"""Cached states give way to requests in a unified KV cache (issue 37, item 2).

With ``kv_unified`` every sequence's KV rows share one set of cells, and a free sequence's cached state
(the prompt cache) holds cells a later request needs. Those states are cleared, the one cached longest ago
first, before a decode would run out of cells and before a checkpoint is restored; a request that fits the
context never fails for cells a cache holds. Before, the server's settings (prompt cache, prefix cache)
failed the second of three requests of 'a '*100, 'b '*100, 'a '*100 in 256 cells (``no memory slot for
a batch of 199 tokens``) and the third raised out of ``step`` (``no free cells to restore a checkpoint``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from rsmem import Batch, Context
from rsmem.engine import Engine, SamplingParams
from rsmem.engine.checkpoints import CheckpointCache
from rsmem.engine.llm import load_text_model
from rsmem.engine.request import FinishReason

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
MODELS = {name: FIXTURES / name / "model-f32.gguf" for name in ("lfm2", "qwen35")}


@pytest.fixture(scope="module", params=list(MODELS))
def loaded(request):
    model, tokenizer = load_text_model(MODELS[request.param])
    return request.param, model, tokenizer


def _engine(
    model, tokenizer, n_seq_max: int, *, unified: bool = True, cache: bool = True, checkpoints: bool = True
) -> Engine:
    """An engine as ``rsmem serve`` builds one (prompt cache, 1 GiB of checkpoints, interval 256)."""
    ctx = Context(model, n_seq_max=n_seq_max, n_ctx=256, kv_unified=unified)
    return Engine(
        ctx,
        tokenizer,
        prompt_cache=cache,
        cache_bytes=(1 << 30) if cache and checkpoints else 0,
        checkpoint_interval=256,
    )


def _run(engine: Engine, prompt, max_tokens: int = 50):
    engine.add_request(prompt, SamplingParams.greedy(max_tokens=max_tokens, ignore_eos=True))
    last = None
    for out in engine.run_until_done():
        last = out
    assert last is not None and last.finished
    return last.outputs[0]


@pytest.mark.parametrize("n_seq_max", [2, 4])
def test_requests_that_fit_never_fail_for_cached_states(loaded, n_seq_max):
    name, model, tokenizer = loaded
    engine = _engine(model, tokenizer, n_seq_max)
    plain = _engine(model, tokenizer, 1, unified=False, cache=False)
    outs = [_run(engine, p) for p in ("a " * 100, "b " * 100, "a " * 100)]
    for out in outs:
        assert out.finish_reason is FinishReason.LENGTH, (name, out.error)  # ERROR / NoSlotError before
        assert len(out.token_ids) == 50
    assert outs[2].text == outs[0].text
    assert outs[1].text == _run(plain, "b " * 100).text
    assert engine.stats.failed_steps == engine.stats.requests_failed == 0
    assert engine.snapshot().health == "ok"
    assert engine.checkpoints is not None and engine.checkpoints.stats.restored == 1  # 'a ' * 100 again
    kv = engine.ctx.memory.kv  # type: ignore[attr-defined]
    assert kv.streams[0].n_used <= 256
    engine.ctx.memory.check_invariants()


def test_the_state_cached_longest_ago_gives_way_first(loaded):
    _, model, tokenizer = loaded
    engine = _engine(model, tokenizer, 4, checkpoints=False)  # the prompt cache alone: no checkpoints
    prompts = [[(s * 31 + 7 * k) % 250 + 1 for k in range(60)] for s in range(4)]
    for p in prompts[:3]:
        _run(engine, p, max_tokens=10)
    assert [len(engine.pool.cached_tokens(s)) for s in range(4)] == [69, 69, 69, 0]  # 207 of 256 cells
    out = _run(engine, prompts[3], max_tokens=10)  # needs 70 cells: one cached state goes
    assert out.finish_reason is FinishReason.LENGTH, out.error
    assert [len(engine.pool.cached_tokens(s)) for s in range(4)] == [0, 69, 69, 69]
    kept = engine.pool.cached_tokens(1)
    again = _run(engine, [*kept, 5], max_tokens=10)  # seq 1's state is still there, and used
    assert again.finish_reason is FinishReason.LENGTH
    assert engine.stats.cache_hits_extension == 1 and engine.stats.failed_steps == 0


def test_a_checkpoint_that_finds_no_cells_is_prefilled_instead(loaded):
    """Without room (here: another running sequence holds the cells), restore_best restores nothing and
    leaves the memory as it was (it raised NoSlotError before)."""
    _, model, _ = loaded
    ctx = Context(model, n_seq_max=3, n_ctx=256, kv_unified=True)
    cache = CheckpointCache.for_context(ctx, 1 << 30)
    prompt = list(range(1, 101))
    ctx.decode(Batch(prompt[:99], seq_ids=[[0]] * 99))
    cache.take(prompt[:99], 0, "prompt")
    ctx.decode(Batch(list(range(1, 151)), seq_ids=[[2]] * 150))  # 249 of the 256 cells taken
    before = ctx.state_get_data()
    assert cache.restore_best(prompt, 1, 0) == 0
    assert ctx.state_get_data() == before
    assert cache.restore_best(prompt, 1, 0, room=lambda ckpt: False) == 0
    assert ctx.state_get_data() == before
    ctx.memory.seq_rm(2, -1, -1)
    assert cache.restore_best(prompt, 1, 0) == 99
    assert ctx.memory.seq_pos_max(1) == 98


def _cached_slots(engine: Engine) -> list[int]:
    return [s for s in range(engine.ctx.n_seq_max) if engine.pool.cached_tokens(s)]


def test_a_sequence_file_restores_while_idle_slots_hold_the_cells(loaded, tmp_path):
    """Restoring a sequence file (into a slot, or a session) clears the idle slots' cached states that
    hold the cells it needs, as a request does."""
    _, model, tokenizer = loaded
    engine = _engine(model, tokenizer, 2, checkpoints=False)
    path = str(tmp_path / "a.ggsq")
    _run(engine, "a " * 100)
    (slot,) = _cached_slots(engine)
    n_tokens, _ = engine.slot_save(slot, path)
    _run(engine, "b " * 100)  # its cells come from the 'a' state, which gives way
    (other,) = _cached_slots(engine)
    target = 1 - other
    assert engine.slot_restore(target, path) == n_tokens  # NoSlotError before: 'b' held the cells
    assert _cached_slots(engine) == [target]
    session = engine.open_session(path)  # the restored 'a' state gives way to the session's copy
    assert len(session.tokens) == n_tokens and _cached_slots(engine) == []
    engine.add_request("a", SamplingParams.greedy(max_tokens=4), session=session)
    assert [o for o in engine.run_until_done() if o.finished][0].outputs[
        0
    ].finish_reason is FinishReason.LENGTH
    engine.ctx.memory.check_invariants()
