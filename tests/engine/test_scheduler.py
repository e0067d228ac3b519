"""Fair scheduling: how a step's token budget is shared among decodes and prompts, and the learnt cap on
one prompt's chunk while others run; plus an engine-level check that a short prompt behind a long one
finishes its prefill first and generates what it generates alone."""

from __future__ import annotations

import torch

from rsmem import Context
from rsmem.engine import Engine, SamplingParams
from rsmem.engine.request import Completion, Phase, Request
from rsmem.engine.scheduler import StepCost, plan_step, step_caps
from rsmem.models import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba2


def request(rid: str, n_prompt: int, *, done: int = 0, phase: Phase = Phase.PREFILL) -> Request:
    c = Completion(0, torch.Generator(), None, seq_id=0)
    if phase is Phase.DECODE:
        c.tokens.append(1)
    return Request(rid, [1] * n_prompt, SamplingParams(), [c], phase=phase, n_prefilled=done)


def shares(plan) -> dict[str, int]:
    return {p.req.request_id: p.n_tokens for p in plan if p.completion is None}


def test_a_lone_prompt_takes_the_whole_budget_whatever_the_cap():
    assert shares(plan_step([request("long", 4000)], 512, prefill_cap=64)) == {"long": 512}


def test_the_oldest_prompt_always_progresses_and_short_ones_go_shortest_first():
    running = [request("long", 4000), request("mid", 300), request("short", 250), request("tiny", 200)]
    plan = plan_step(running, 512, prefill_cap=None)  # no cap: the budget is the only limit
    assert shares(plan) == {"long": 512}  # the oldest first: it is never starved
    plan = plan_step(running, 512, prefill_cap=128)
    # the oldest gets its capped chunk, then the shortest remaining first, each capped
    assert shares(plan) == {"long": 128, "tiny": 128, "short": 128, "mid": 128}
    assert [p.req.request_id for p in plan] == ["long", "tiny", "short", "mid"]


def test_prompts_a_step_finishes_run_without_the_others():
    """A step that completes short prompts carries only them (and the decodes), shortest first: their
    first tokens wait for a short step, not for the long prompts' chunks beside them."""
    dec = request("dec", 5, done=5, phase=Phase.DECODE)
    running = [dec, request("long", 4000), request("mid", 300), request("short", 3), request("tiny", 2)]
    plan = plan_step(running, 512, prefill_cap=128)
    assert shares(plan) == {"tiny": 2, "short": 3}
    assert [p.req.request_id for p in plan] == ["dec", "tiny", "short"] and all(p.output for p in plan)
    rest = [dec, request("long", 4000), request("mid", 300, done=200)]
    assert shares(plan_step(rest, 512, prefill_cap=128)) == {"mid": 100}  # the rest of mid fits: alone
    assert shares(plan_step(rest[:2], 512, prefill_cap=128)) == {"long": 128}  # nothing finishes
    assert shares(plan_step(running, 512, prefill_cap=0)) == {"long": 511}  # no cap: first come first


def test_a_lone_prompt_is_capped_by_alone_cap():
    assert shares(plan_step([request("long", 4000)], 512, prefill_cap=32, alone_cap=128)) == {"long": 128}
    assert shares(plan_step([request("long", 100)], 512, prefill_cap=32, alone_cap=128)) == {"long": 100}
    assert shares(plan_step([request("long", 4000)], 512, prefill_cap=32, alone_cap=0)) == {"long": 512}


def test_decodes_come_first_and_a_prompt_beside_them_is_capped():
    running = [request("dec", 5, done=5, phase=Phase.DECODE), request("long", 4000)]
    plan = plan_step(running, 512, prefill_cap=48)
    assert plan[0].req.request_id == "dec" and plan[0].completion is not None and plan[0].n_tokens == 1
    assert shares(plan) == {"long": 48}
    assert sum(p.n_tokens for p in plan_step(running, 512, prefill_cap=0)) == 512  # 0: no cap


def test_chunks_still_end_where_a_checkpoint_is_due():
    req = request("long", 4000, done=100)
    req.checkpoint_at = [130, 900]
    assert shares(plan_step([req], 512, prefill_cap=None)) == {"long": 30}


def test_step_cost_learns_a_cap_that_matches_a_steps_fixed_cost():
    cost = StepCost(floor=16, ceiling=512)
    assert cost.prefill_cap() == 512  # nothing learnt: the budget decides
    for _ in range(20):
        cost.observe(4, 0.010)  # a decode step: 10 ms
        cost.observe(256, 0.010 + 256 * 0.0001)  # 0.1 ms a token
    assert abs(cost.prefill_cap() - 100) <= 2  # 10 ms of tokens at 0.1 ms each
    slow = StepCost(floor=16, ceiling=512)
    for _ in range(5):
        slow.observe(1, 0.001)
        slow.observe(64, 0.001 + 64 * 0.01)
    assert slow.prefill_cap() == 16  # never below the floor


def test_step_cost_bounds_a_lone_prompts_steps_once_learnt():
    cost = StepCost(floor=16, ceiling=512)
    assert cost.alone_cap() is None  # nothing learnt: the budget
    for _ in range(20):
        cost.observe(4, 0.004)
        cost.observe(128, 0.004 + 128 * 0.0002)  # cap: 20 tokens
    assert cost.alone_cap() == StepCost.ALONE * cost.prefill_cap() == StepCost.ALONE * 20
    cheap = StepCost(floor=16, ceiling=512)
    for _ in range(20):
        cheap.observe(4, 0.004)
        cheap.observe(512, 0.004 + 512 * 0.000001)
    assert cheap.alone_cap() == 512  # never above the ceiling


def test_the_engine_caps_a_lone_prompt_only_when_the_cap_is_learnt():
    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=64, d_state=8, n_head=4, n_group=2, chunk_size=4)
    model = random_mamba2(cfg, seed=3)
    sizes: dict[str, list[int]] = {}
    for name, cap in (("auto", None), ("fixed", 8)):
        engine = Engine(Context(model, n_seq_max=2, n_batch=256, n_ubatch=256), prefill_cap=cap)
        for _ in range(20):  # what the costs would teach: a fixed cost worth 10 tokens
            engine.step_cost.observe(2, 0.010)
            engine.step_cost.observe(200, 0.010 + 200 * 0.001)
        engine.add_request([(5 * k) % 64 for k in range(600)], SamplingParams.greedy(max_tokens=1))
        seen = sizes.setdefault(name, [])
        while engine.has_unfinished:
            before = engine.stats.prompt_tokens
            engine.step()
            seen.append(engine.stats.prompt_tokens - before)
    assert sizes["auto"][0] == StepCost.ALONE * engine.step_cost.prefill_cap() < 256
    assert sizes["fixed"][:2] == [256, 256]  # a cap set by hand: alone the budget, as before


def test_a_short_prompt_behind_a_long_one_prefills_first_and_generates_as_alone():
    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=64, d_state=8, n_head=4, n_group=2, chunk_size=4)
    model = random_mamba2(cfg, seed=3)
    greedy = SamplingParams.greedy(max_tokens=3)
    engine = Engine(Context(model, n_seq_max=2, n_batch=64, n_ubatch=64), prefill_cap=8)
    long_id = engine.add_request([(5 * k) % 64 for k in range(300)], greedy)
    engine.step()  # the long prompt starts alone, with the whole budget
    short_id = engine.add_request([3, 4, 5], greedy)
    first_token: dict[str, int] = {}
    outputs = {}
    for n_step in range(1, 200):
        for out in engine.step():
            if out.outputs[0].token_ids:
                first_token.setdefault(out.request_id, n_step)
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished:
            break
    assert first_token[short_id] == 1  # in the next step, not after the long prompt's 300 tokens
    assert first_token[long_id] > 3  # capped to 8 tokens a step beside the short one, then alone again
    alone = Engine(Context(model, n_seq_max=1, n_batch=64, n_ubatch=64))
    rid = alone.add_request([3, 4, 5], greedy)
    expected = next(o for o in alone.run_until_done() if o.finished and o.request_id == rid)
    assert outputs[short_id] == expected.outputs[0].token_ids


def test_learnt_caps_give_way_to_the_ceiling_while_requests_wait_for_a_sequence():
    """A saturated engine (requests queued for a sequence) runs prompts in large chunks: the queued
    requests wait on throughput, and every small chunk pays the prompt path's fixed cost."""
    cost = StepCost(floor=16, ceiling=512)
    for _ in range(20):
        cost.observe(4, 0.004)
        cost.observe(128, 0.004 + 128 * 0.0002)  # cap: 20 tokens
    assert step_caps(None, cost) == (20, StepCost.ALONE * 20)
    assert step_caps(None, cost, queued=True) == (512, 512)
    assert step_caps(8, cost, queued=True) == (8, None)  # a cap set by hand holds

    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=64, d_state=8, n_head=4, n_group=2, chunk_size=4)
    model = random_mamba2(cfg, seed=3)
    sizes: dict[int, list[int]] = {}
    for n_requests in (1, 2):
        engine = Engine(Context(model, n_seq_max=1, n_batch=256, n_ubatch=256))
        for _ in range(20):  # a fixed cost worth 10 tokens: cap 32 (the floor), alone 128
            engine.step_cost.observe(2, 0.010)
            engine.step_cost.observe(200, 0.010 + 200 * 0.001)
        engine.step_cost.observe = lambda n_tokens, seconds: None  # type: ignore[method-assign]
        for _ in range(n_requests):
            engine.add_request([(5 * k) % 64 for k in range(600)], SamplingParams.greedy(max_tokens=1))
        seen = sizes.setdefault(n_requests, [])
        while engine.has_unfinished:
            before = engine.stats.prompt_tokens
            engine.step()
            seen.append(engine.stats.prompt_tokens - before)
    assert sizes[1][0] == StepCost.ALONE * 32  # alone, nobody waiting: the learnt bound
    assert sizes[2][:2] == [256, 256]  # the second request waits for the only sequence: the budget
    assert sizes[2] == [256, 256, 88, 128, 128, 128, 128, 88]  # then the second alone: the learnt bound
