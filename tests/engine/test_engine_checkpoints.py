"""The engine's prefix cache of checkpoints: prompts that share a prefix with a cached one compute only
the rest, and generate exactly what they generate from scratch."""

from __future__ import annotations

import pytest

from rsmem import Context
from rsmem.engine import Engine, SamplingParams
from rsmem.models import DecayedSumModel, Mamba2Config
from rsmem.models.mamba.random_init import random_mamba2

N_VOCAB = 64
GREEDY = SamplingParams.greedy(max_tokens=6)


def make_model(name: str):
    if name == "toy":
        return DecayedSumModel(n_vocab=N_VOCAB, n_embd=6, n_layer=3, seed=4)
    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=4)
    return random_mamba2(cfg, seed=3)


def engine_for(model, cache_bytes: int = 1 << 24, **kw) -> Engine:
    return Engine(Context(model, n_seq_max=2, n_batch=64, n_ubatch=16), cache_bytes=cache_bytes, **kw)


def run(engine: Engine, prompt: list[int], params: SamplingParams = GREEDY, **kw):
    rid = engine.add_request(prompt, params, **kw)
    return next(o for o in engine.run_until_done() if o.finished and o.request_id == rid)


def fresh(model, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[int, ...]:
    return (
        run(Engine(Context(model, n_seq_max=1, n_batch=64, n_ubatch=16)), prompt, params).outputs[0].token_ids
    )


def seq(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % N_VOCAB for k in range(n)]


@pytest.mark.parametrize("name", ["toy", "mamba2"])
def test_a_regenerated_prompt_computes_one_token(name):
    model = make_model(name)
    engine = engine_for(model)
    prompt = seq(1, 30)
    first = run(engine, prompt)
    engine.add_request(seq(40, 5), GREEDY)  # another request takes over the first's sequence
    list(engine.run_until_done())
    again = run(engine, prompt)
    assert again.num_cached_tokens == len(prompt) - 1
    assert again.outputs[0].token_ids == first.outputs[0].token_ids == fresh(model, prompt)


@pytest.mark.parametrize("name", ["toy", "mamba2"])
def test_a_shared_prefix_is_kept_where_prompts_diverge(name):
    model = make_model(name)
    engine = engine_for(model)
    system = seq(3, 40)
    prompts = [system + seq(10 * k, 5 + k) for k in range(1, 5)]
    outs = [run(engine, p) for p in prompts]
    assert outs[0].num_cached_tokens == 0
    assert all(o.num_cached_tokens >= len(system) for o in outs[2:])  # the divergence point is kept
    for p, o in zip(prompts, outs, strict=True):
        assert o.outputs[0].token_ids == fresh(model, p)


def test_a_chat_turn_whose_tokens_differ_near_the_end_rolls_back_to_a_checkpoint_not_to_zero():
    model = make_model("mamba2")
    engine = engine_for(model)
    turn1 = seq(5, 50)
    out1 = run(engine, turn1)
    # the client re-sends the answer re-tokenised differently, then a new message
    turn2 = turn1 + [(t + 1) % N_VOCAB for t in out1.outputs[0].token_ids] + seq(9, 12)
    engine.add_request(seq(40, 5), GREEDY)  # the turn-1 sequence is taken meanwhile
    list(engine.run_until_done())
    out2 = run(engine, turn2)
    assert out2.num_cached_tokens == len(turn1) - 1
    assert out2.outputs[0].token_ids == fresh(model, turn2)


def test_boundaries_and_intervals_are_checkpointed():
    model = make_model("toy")
    engine = engine_for(model, checkpoint_interval=16)
    prompt = seq(2, 70)
    run(engine, prompt, boundaries=(10, 25))
    keys = sorted(len(k) for k, _, _ in engine.checkpoints.tree.items())
    assert {10, 16, 25, 32, 48, 64, 69} <= set(keys)
    other = prompt[:30] + seq(50, 10)
    out = run(engine, other)
    assert out.num_cached_tokens == 25
    assert out.outputs[0].token_ids == fresh(model, other)


@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_checkpoints_inside_a_prefill_are_captured_without_cutting_its_chunks(arch):
    from rsmem.models import MambaConfig
    from rsmem.models.mamba.random_init import random_mamba

    if arch == "mamba":
        model = random_mamba(MambaConfig(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8), seed=5)
    else:
        model = make_model("mamba2")
    engine = engine_for(model, checkpoint_interval=8)
    prompt = seq(2, 50)
    rid = engine.add_request(prompt, GREEDY, boundaries=(13,))
    engine.step()
    assert engine.stats.steps == 1 and engine.stats.prompt_tokens == 50  # one chunk, not cut at 8, 13, ...
    list(engine.run_until_done())
    keys = {len(k) for k, _, _ in engine.checkpoints.tree.items()}
    assert {8, 13, 16, 24, 32, 40, 48, 49} <= keys
    for cut in (13, 24, 49):  # restored from a captured checkpoint: as if computed from the start
        other = prompt[:cut] + seq(31, 7)
        out = run(engine, other)
        assert out.num_cached_tokens == cut
        assert out.outputs[0].token_ids == fresh(model, other)
    assert rid not in engine.requests


def test_a_budget_too_small_for_any_checkpoint_still_generates_correctly():
    model = make_model("mamba2")
    engine = engine_for(model, cache_bytes=16)
    prompt = seq(1, 20)
    assert run(engine, prompt).outputs[0].token_ids == fresh(model, prompt)
    assert len(engine.checkpoints) == 0 and engine.checkpoints.stats.refused > 0


@pytest.mark.parametrize("codec", ["bf16", "int8"])
def test_compressed_checkpoints_serve_and_shrink(codec):
    model = make_model("mamba2")
    exact, lossy = engine_for(model), engine_for(model, checkpoint_codec=codec)
    prompt = seq(1, 30)
    for engine in (exact, lossy):
        run(engine, prompt)
    assert lossy.checkpoints.nbytes < exact.checkpoints.nbytes * 0.6
    assert run(lossy, prompt).num_cached_tokens == len(prompt) - 1


def test_a_non_finite_state_is_never_checkpointed():
    from rsmem.models.faulty import FaultyModel

    model = FaultyModel(make_model("mamba2"))
    engine = engine_for(model)
    prompt = seq(1, 20)
    model.poison(0)
    bad = run(engine, prompt, slot=0)
    assert bad.error is not None
    assert len(engine.checkpoints) == 0 and engine.checkpoints.stats.non_finite > 0
    good = run(engine, prompt)
    assert good.num_cached_tokens == 0 and good.outputs[0].token_ids == fresh(model.inner, prompt)


def test_cache_use_is_counted_by_kind():
    model = make_model("toy")
    engine = Engine(Context(model, n_seq_max=2, n_batch=64), prompt_cache=True, cache_bytes=1 << 24)
    prompt = seq(1, 12)
    first = run(engine, prompt)  # computed in full
    extended = run(engine, [*prompt, *first.outputs[0].token_ids[:-1], 5])  # the slot's own state
    engine.add_request(seq(30, 4), GREEDY, slot=0)  # the first sequence is taken over
    engine.add_request(seq(40, 4), GREEDY, slot=1)
    list(engine.run_until_done())
    again = run(engine, prompt)  # only a checkpoint can serve it now
    assert extended.num_cached_tokens > len(prompt) and again.num_cached_tokens == len(prompt) - 1
    snap = engine.snapshot()
    assert (snap.cache_hits_extension, snap.cache_hits_checkpoint) == (1, 1)
    assert snap.cache_misses == 3
