"""Shared in-flight prefixes: requests that arrive together with a common prefix nobody has cached
prefill it once (the others wait for the first one's checkpoint, then restore it), and generate exactly
what each generates alone; a leader that is aborted or fails leaves its followers to go on alone."""

from __future__ import annotations

import functools

import pytest

from rsmem import Context
from rsmem.engine import Engine, SamplingParams
from rsmem.engine.admission import MIN_SHARED, common_prefix, wait_bound
from rsmem.models import Mamba2Config
from rsmem.models.faulty import FaultyModel
from rsmem.models.mamba.random_init import random_mamba2

N_VOCAB = 64
GREEDY = SamplingParams.greedy(max_tokens=6)
SYSTEM = [(3 + 7 * k) % N_VOCAB for k in range(100)]


def make_model():
    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=4)
    return random_mamba2(cfg, seed=3)


def tail(k: int, n: int = 6) -> list[int]:
    return [(11 * k + 5 * j + 1) % N_VOCAB for j in range(n)]


def engine_for(model, **kw) -> Engine:
    return Engine(Context(model, n_seq_max=4, n_batch=64, n_ubatch=16), cache_bytes=1 << 24, **kw)


def fresh(model, prompt: list[int]) -> tuple[int, ...]:
    engine = Engine(Context(model, n_seq_max=1, n_batch=64, n_ubatch=16))
    rid = engine.add_request(prompt, GREEDY)
    return next(o for o in engine.run_until_done() if o.request_id == rid and o.finished).outputs[0].token_ids


def count_prefix_tokens(model, below: int) -> list[int]:
    """Wrap ``model.forward``: the returned list's one item counts the tokens at positions < ``below``
    the model was given."""
    seen = [0]
    original = model.forward

    @functools.wraps(original)
    def forward(ubatch, states, **kw):
        seen[0] += sum(1 for p in ubatch.pos if p < below)
        return original(ubatch, states, **kw)

    model.forward = forward
    return seen


def finished(engine: Engine) -> dict[str, object]:
    return {o.request_id: o for o in engine.run_until_done() if o.finished}


def test_three_requests_with_a_common_system_prompt_prefill_it_once():
    model = make_model()
    prompts = [SYSTEM + tail(k) for k in range(3)]
    expected = [fresh(model, p) for p in prompts]
    seen = count_prefix_tokens(model, len(SYSTEM))
    engine = engine_for(model)
    ids = [engine.add_request(p, GREEDY, boundaries=[len(SYSTEM)]) for p in prompts]
    outs = finished(engine)
    assert seen[0] == len(SYSTEM)  # the shared prefix went through the model once
    assert [outs[i].outputs[0].token_ids for i in ids] == expected
    assert [outs[i].num_cached_tokens for i in ids] == [0, len(SYSTEM), len(SYSTEM)]
    assert engine.stats.shared_prefix_waits == 2


def test_prompts_sharing_a_prefix_without_boundaries_wait_for_a_checkpoint_where_they_part():
    model = make_model()
    prompts = [SYSTEM[:70] + tail(k) for k in range(2)]
    expected = [fresh(model, p) for p in prompts]
    engine = engine_for(model)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    outs = finished(engine)
    assert [outs[i].outputs[0].token_ids for i in ids] == expected
    assert outs[ids[1]].num_cached_tokens == common_prefix(*prompts) >= 70


def test_without_waiting_the_prefix_is_computed_by_each():
    """The other side of the first test: one at a time in separate engines, the prefix goes through the
    model once per request (so the first test's count could fail)."""
    model = make_model()
    seen = count_prefix_tokens(model, len(SYSTEM))
    for k in range(3):
        fresh(model, SYSTEM + tail(k))
    assert seen[0] == 3 * len(SYSTEM)


def test_an_unrelated_request_is_not_held_up_by_waiting_ones():
    model = make_model()
    engine = engine_for(model)
    engine.add_request(SYSTEM + tail(0), GREEDY, boundaries=[len(SYSTEM)])
    waiter = engine.add_request(SYSTEM + tail(1), GREEDY, boundaries=[len(SYSTEM)])
    other = engine.add_request(tail(9, 40), GREEDY)
    engine.step()
    running = {r.request_id for r in engine.running}
    assert other in running and waiter not in running
    assert engine.snapshot().waiting == 1


def test_a_short_or_cached_common_prefix_is_not_waited_for():
    model = make_model()
    engine = engine_for(model)
    short = SYSTEM[: MIN_SHARED - 2]
    engine.add_request(short + tail(0, 40), GREEDY)
    engine.add_request(short + tail(1, 40), GREEDY)
    engine.step()
    assert len(engine.running) == 2 and engine.stats.shared_prefix_waits == 0
    list(engine.run_until_done())
    # the system prompt is cached after one request: nothing to wait for
    engine.add_request(SYSTEM + tail(2), GREEDY, boundaries=[len(SYSTEM)])
    list(engine.run_until_done())
    engine.add_request(SYSTEM + tail(3), GREEDY, boundaries=[len(SYSTEM)])
    engine.add_request(SYSTEM + tail(4), GREEDY, boundaries=[len(SYSTEM)])
    engine.step()
    assert len(engine.running) == 2 and engine.stats.shared_prefix_waits == 0


def test_followers_of_a_leader_aborted_mid_prefill_go_on_alone():
    model = make_model()
    prompts = [SYSTEM + tail(k) for k in range(3)]
    expected = [fresh(model, p) for p in prompts]
    engine = engine_for(model)
    ids = [engine.add_request(p, GREEDY, boundaries=[len(SYSTEM)]) for p in prompts]
    engine.step()
    assert 0 < engine.request_progress(ids[0])[0] < len(SYSTEM)  # mid-prefill, the others waiting
    assert engine.snapshot().waiting == 2
    assert engine.abort(ids[0])
    steps_before = engine.stats.steps
    aborted = [o for o in engine.step() if o.request_id == ids[0]]
    assert aborted[0].outputs[0].finish_reason == "abort"
    assert engine.snapshot().waiting == 0  # both started at once, on their own
    outs = finished(engine)
    assert [outs[i].outputs[0].token_ids for i in ids[1:]] == expected[1:]
    assert engine.stats.steps - steps_before < 2 * wait_bound(len(SYSTEM))


def test_followers_of_a_leader_the_model_fails_on_go_on_alone():
    inner = make_model()
    prompts = [SYSTEM + tail(k) for k in range(3)]
    expected = [fresh(inner, p) for p in prompts]
    model = FaultyModel(inner)
    engine = engine_for(model)
    ids = [engine.add_request(p, GREEDY, boundaries=[len(SYSTEM)]) for p in prompts]
    engine.step()
    leader_seq = engine.running[0].prefill_seq
    model.raise_when(lambda seqs: leader_seq in seqs)
    failed = [o for o in engine.step() if o.request_id == ids[0]]  # the leader's batch (it alone) fails
    model.raise_when(None)
    assert failed[0].outputs[0].finish_reason == "error"
    outs = finished(engine)
    assert [outs[i].outputs[0].token_ids for i in ids[1:]] == expected[1:]


@pytest.mark.parametrize(
    ("a", "b", "n"),
    [([], [1], 0), ([1, 2, 3], [1, 2, 3], 3), ([1, 2, 3], [1, 2], 2), ([1, 2, 3, 4, 5], [1, 2, 9, 4, 5], 2)],
)
def test_common_prefix(a, b, n):
    assert common_prefix(a, b) == common_prefix(b, a) == n


def test_a_session_request_is_never_a_leader():
    """A session's prompt continues the session's state, so its tokens alone are not the prefix its
    checkpoints would fold: a request sharing them must compute its own."""
    model = make_model()
    engine = engine_for(model)
    session = engine.open_session()
    engine.add_request(tail(7, 10), GREEDY, session=session)
    list(engine.run_until_done())
    # the session's next prompt is its pending token and these: the same tokens as ``prompt`` starts with
    prompt = session.pending + SYSTEM + tail(1)
    expected = fresh(model, prompt)
    engine.add_request(SYSTEM + tail(0), GREEDY, session=session)
    rid = engine.add_request(prompt, GREEDY, boundaries=[len(SYSTEM)])
    outs = finished(engine)
    assert engine.stats.shared_prefix_waits == 0
    assert outs[rid].outputs[0].token_ids == expected
