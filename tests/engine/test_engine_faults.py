"""Fault injection into the engine: a failure stays with the request it belongs to.

Every test runs good requests next to a failing one and checks that the good ones produce exactly the
tokens they produce alone, that the failing one ends with ``FinishReason.ERROR`` and the right
``error_kind``, and that afterwards the memory holds nothing of it and the engine serves again.
"""

from __future__ import annotations

import math

import pytest

from rsmem import Context
from rsmem.engine import LLM, Engine, FinishReason, SamplingParams
from rsmem.engine.request import ErrorKind
from rsmem.errors import InvalidRequestError
from rsmem.models import DecayedSumModel
from rsmem.models.faulty import FaultyModel, InjectedFault

N_VOCAB = 257
GOOD = [
    ([5, 9, 13, 2, 7], SamplingParams.greedy(max_tokens=10)),
    ([1, 2, 3], SamplingParams(temperature=0.9, seed=7, max_tokens=12, n=2)),
    ([40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50, 51], SamplingParams.greedy(max_tokens=8)),
]
CULPRIT_PROMPT = [9, 8, 7, 6]
CULPRIT_SLOT = 7


def toy() -> DecayedSumModel:
    return DecayedSumModel(n_vocab=N_VOCAB, n_embd=6, n_layer=3, seed=3)


def make_engine(model=None, *, prompt_cache: bool = False, max_batch_tokens: int = 16) -> Engine:
    ctx = Context(model or toy(), n_seq_max=8, n_batch=64, n_ubatch=16)
    return Engine(ctx, max_batch_tokens=max_batch_tokens, prompt_cache=prompt_cache)


def alone(prompt: list[int], params: SamplingParams) -> list[tuple[int, ...]]:
    engine = make_engine()
    rid = engine.add_request(prompt, params)
    final = {o.request_id: o for o in engine.run_until_done() if o.finished}
    return [c.token_ids for c in final[rid].outputs]


def run_all(engine: Engine) -> dict:
    return {o.request_id: o for o in engine.run_until_done() if o.finished}


def assert_good_exact(engine: Engine, final: dict, good_ids: list[str]) -> None:
    for rid, (prompt, params) in zip(good_ids, GOOD, strict=True):
        out = final[rid]
        assert out.error is None, out.error
        assert [c.token_ids for c in out.outputs] == alone(prompt, params)


def assert_clean(engine: Engine) -> None:
    snap = engine.snapshot()
    assert snap.running == 0 and snap.waiting == 0 and snap.free_slots == 8
    assert snap.cells_active == 0
    assert engine.ctx.memory.used == 0  # no prompt cache in these engines
    assert not engine.requests


def submit_good(engine: Engine) -> list[str]:
    return [engine.add_request(p, sp) for p, sp in GOOD]


@pytest.mark.parametrize("after_layers", [0, 2])  # before any state is written, and half-written
@pytest.mark.parametrize("fail_at_step", [0, 3])  # in the culprit's prefill, and in its decode
def test_model_fault_fails_only_the_request_it_belongs_to(after_layers, fail_at_step):
    model = FaultyModel(toy())
    engine = make_engine(model)
    good = submit_good(engine)
    culprit = engine.add_request(CULPRIT_PROMPT, SamplingParams.greedy(max_tokens=20), slot=CULPRIT_SLOT)
    model.raise_when(
        lambda seqs: CULPRIT_SLOT in seqs and engine.stats.steps >= fail_at_step, after_layers=after_layers
    )
    final = run_all(engine)
    bad = final[culprit]
    assert bad.outputs[0].finish_reason is FinishReason.ERROR
    assert bad.error_kind is ErrorKind.MODEL and "InjectedFault" in bad.error
    assert_good_exact(engine, final, good)
    assert_clean(engine)
    assert engine.stats.requests_failed == 1
    health = engine.snapshot()
    assert health.health == "degraded" and "InjectedFault" in health.health_reason
    model.raise_when(None)  # the engine serves again, in the culprit's slot too
    rid = engine.add_request(CULPRIT_PROMPT, SamplingParams.greedy(max_tokens=5), slot=CULPRIT_SLOT)
    assert [c.token_ids for c in run_all(engine)[rid].outputs] == alone(
        CULPRIT_PROMPT, SamplingParams.greedy(max_tokens=5)
    )


def test_a_transient_fault_fails_nobody():
    model = FaultyModel(toy())
    engine = make_engine(model)
    good = submit_good(engine)
    fired = []

    def once(seqs: frozenset[int]) -> bool:
        if engine.stats.steps == 4 and not fired:
            fired.append(seqs)
            return True
        return False

    model.raise_when(once)
    final = run_all(engine)
    assert fired and model.faults_raised == 1
    assert_good_exact(engine, final, good)
    assert engine.stats.requests_failed == 0
    assert_clean(engine)


def test_a_model_that_always_fails_fails_every_request_and_health_says_error():
    model = FaultyModel(toy())
    engine = make_engine(model)
    model.raise_when(lambda seqs: True)
    ids = submit_good(engine)
    final = run_all(engine)
    assert all(final[r].outputs[0].finish_reason is FinishReason.ERROR for r in ids)
    assert engine.snapshot().health == "error"
    assert_clean(engine)
    model.raise_when(None)
    rid = engine.add_request([1, 2], SamplingParams.greedy(max_tokens=2))
    assert run_all(engine)[rid].error is None
    assert engine.snapshot().health == "degraded"  # recovered; the failure is recent


def test_logits_a_request_cannot_sample_fail_it_alone():
    engine = make_engine()
    good = submit_good(engine)
    ban_all = {t: -math.inf for t in range(N_VOCAB)}
    bad = engine.add_request([3, 4], SamplingParams(logit_bias=ban_all, max_tokens=4))
    final = run_all(engine)
    assert final[bad].outputs[0].finish_reason is FinishReason.ERROR
    assert final[bad].error_kind is ErrorKind.REQUEST and "sampling parameters" in final[bad].error
    assert_good_exact(engine, final, good)
    assert_clean(engine)
    assert engine.snapshot().health == "ok"  # not the model's fault


def test_a_nan_state_fails_its_request_alone_and_is_cleared():
    model = FaultyModel(toy())
    engine = make_engine(model)
    good = submit_good(engine)
    bad = engine.add_request(CULPRIT_PROMPT, SamplingParams.greedy(max_tokens=20), slot=CULPRIT_SLOT)
    for _ in range(3):
        engine.step()
    model.poison(CULPRIT_SLOT)
    final = run_all(engine)
    assert final[bad].outputs[0].finish_reason is FinishReason.ERROR
    assert final[bad].error_kind is ErrorKind.REQUEST and "non-finite" in final[bad].error
    assert_good_exact(engine, final, good)
    assert_clean(engine)
    rid = engine.add_request(CULPRIT_PROMPT, SamplingParams.greedy(max_tokens=5), slot=CULPRIT_SLOT)
    assert [c.token_ids for c in run_all(engine)[rid].outputs] == alone(
        CULPRIT_PROMPT, SamplingParams.greedy(max_tokens=5)
    )


def test_a_failed_request_caches_nothing():
    """Defect 3: after a model exception the prompt cache must not claim the wiped state."""
    model = FaultyModel(toy())
    engine = make_engine(model, prompt_cache=True)
    first = engine.add_request([1, 2, 3, 4], SamplingParams.greedy(max_tokens=3), slot=2)
    done = run_all(engine)[first].outputs[0].token_ids
    prompt = [1, 2, 3, 4, *done[:-1], 5, 6]
    assert engine.pool.cached_tokens(2)  # the finished request's state is cached
    model.raise_when(lambda seqs: 2 in seqs)
    failed = engine.add_request(prompt, SamplingParams.greedy(max_tokens=3))
    out = run_all(engine)[failed]
    assert out.num_cached_tokens > 0 and out.outputs[0].finish_reason is FinishReason.ERROR
    assert engine.pool.cached_tokens(2) == [] and engine.ctx.memory.seq_pos_max(2) == -1
    model.raise_when(None)
    again = engine.add_request(prompt, SamplingParams.greedy(max_tokens=3))
    out = run_all(engine)[again]
    assert out.num_cached_tokens == 0
    assert [c.token_ids for c in out.outputs] == alone(prompt, SamplingParams.greedy(max_tokens=3))


def test_a_session_survives_a_fault_caused_by_another_request():
    model = FaultyModel(toy())
    engine = make_engine(model)
    session = engine.open_session()
    greedy = SamplingParams.greedy(max_tokens=4)
    engine.add_request([1, 2, 3], greedy, session=session)
    run_all(engine)
    history = list(session.tokens) + list(session.pending)
    turn = engine.add_request([7, 8], greedy, session=session)
    engine.add_request(CULPRIT_PROMPT, SamplingParams.greedy(max_tokens=20), slot=CULPRIT_SLOT)
    model.raise_when(lambda seqs: CULPRIT_SLOT in seqs and engine.stats.steps >= 4)
    out = run_all(engine)[turn]
    assert out.error is None
    assert [c.token_ids for c in out.outputs] == alone([*history, 7, 8], greedy)


def test_a_session_whose_request_fails_is_emptied_not_lost():
    model = FaultyModel(toy())
    engine = make_engine(model)
    session = engine.open_session()
    model.raise_when(lambda seqs: session.seq_id in seqs)
    rid = engine.add_request([1, 2, 3], SamplingParams.greedy(max_tokens=4), session=session)
    assert run_all(engine)[rid].error_kind is ErrorKind.MODEL
    assert session.tokens == [] and session.pending == [] and not session.busy
    model.raise_when(None)
    rid = engine.add_request([1, 2, 3], SamplingParams.greedy(max_tokens=4), session=session)
    assert [c.token_ids for c in run_all(engine)[rid].outputs] == alone(
        [1, 2, 3], SamplingParams.greedy(max_tokens=4)
    )


def test_an_interrupt_inside_decode_ends_the_batch_and_leaves_a_usable_engine():
    model = toy()
    engine = make_engine(model)

    class Interrupting:
        def __getattr__(self, name):
            return getattr(model, name)

        def forward(self, ubatch, states):
            raise KeyboardInterrupt

    engine.ctx.model = Interrupting()
    rid = engine.add_request([1, 2], SamplingParams.greedy(max_tokens=3))
    with pytest.raises(KeyboardInterrupt):
        engine.step()
    engine.ctx.model = model
    final = run_all(engine)
    assert final == {} or final[rid].outputs[0].finish_reason is FinishReason.ABORT
    assert_clean(engine)
    assert engine.snapshot().health == "ok"


def test_invalid_requests_are_refused_before_anything_is_queued():
    engine = make_engine()
    cases = [
        (lambda: SamplingParams(repetition_penalty=1e-40), "repetition_penalty"),
        (lambda: SamplingParams(temperature=-1), "temperature"),
        (lambda: SamplingParams(top_p=0.0), "top_p"),
        (lambda: SamplingParams(logprobs=21), "logprobs"),
        (lambda: engine.add_request([N_VOCAB]), "prompt"),
        (lambda: engine.add_request([]), "prompt"),
        (lambda: engine.add_request([1], SamplingParams(logit_bias={N_VOCAB: 1.0})), "logit_bias"),
        (lambda: engine.add_request([1], slot=8), "slot"),
        (lambda: engine.add_request([1], SamplingParams(n=9)), "n"),
        (lambda: engine.add_request("text"), "prompt"),  # no tokenizer
    ]
    for make, param in cases:
        with pytest.raises(InvalidRequestError) as info:
            make()
        assert info.value.param == param, info.value
    with pytest.raises(InvalidRequestError, match=r"prompt 1"):
        engine.add_requests([[1, 2], [N_VOCAB]], SamplingParams.greedy(max_tokens=2))
    assert not engine.requests and not engine.has_unfinished  # all or none


def test_server_limits_are_checked_by_the_engine():
    ctx = Context(toy(), n_seq_max=2, n_batch=64)
    engine = Engine(ctx, max_prompt_tokens=4, max_tokens_limit=8)
    with pytest.raises(InvalidRequestError) as info:
        engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=4))
    assert info.value.param == "prompt" and "limit of 4" in str(info.value)
    for bad in (SamplingParams(max_tokens=9), SamplingParams(max_tokens=None)):
        with pytest.raises(InvalidRequestError) as info:
            engine.add_request([1], bad)
        assert info.value.param == "max_tokens"


def test_several_prompts_are_queued_together_and_batched():
    engine = make_engine()
    ids = engine.add_requests([p for p, _ in GOOD], [sp for _, sp in GOOD])
    engine.step()
    assert engine.snapshot().running == 3  # all three in the first batch
    final = run_all(engine)
    for rid, (prompt, params) in zip(ids, GOOD, strict=True):
        assert [c.token_ids for c in final[rid].outputs] == alone(prompt, params)


def test_llm_generate_survives_a_failing_request(tmp_path):
    """Defect 2: a failing request used to leave the engine raising IndexError for ever."""
    llm = LLM(toy(), n_seq_max=4, n_batch=64)
    ban_all = {t: -math.inf for t in range(N_VOCAB)}
    outs = llm.generate(
        [[1, 2, 3], [4, 5]], [SamplingParams(logit_bias=ban_all), SamplingParams.greedy(max_tokens=3)]
    )
    assert outs[0].outputs[0].finish_reason is FinishReason.ERROR and outs[1].error is None
    again = llm.generate([[4, 5]], SamplingParams.greedy(max_tokens=3))
    assert again[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert not llm.engine.requests


def test_unlimited_max_tokens_stops_at_a_stop_condition():
    engine = make_engine()
    rid = engine.add_request([1, 2], SamplingParams.greedy(max_tokens=None))
    for _ in range(30):
        engine.step()
    assert engine.request_progress(rid) == (2, 2)
    assert engine.abort(rid)
    assert engine.request_progress(rid) is None


def test_injected_fault_type():
    assert issubclass(InjectedFault, RuntimeError)


def test_saving_a_session_decodes_a_pending_tail_longer_than_a_batch(tmp_path):
    ctx = Context(toy(), n_seq_max=2, n_batch=16, n_ubatch=16)
    engine = Engine(ctx)
    session = engine.open_session()
    prompt = [(7 * k) % N_VOCAB for k in range(40)]
    rid = engine.add_request(prompt, SamplingParams.greedy(max_tokens=2), session=session)
    engine.step()  # 16 of 40 prompt tokens in
    engine.abort(rid)
    assert len(session.pending) == 24 > ctx.n_batch
    engine.save_session(session, str(tmp_path / "s.ggsq"))
    assert session.tokens == prompt and session.pending == []
    fresh = Engine(Context(toy(), n_seq_max=1, n_batch=64))
    restored = fresh.open_session(str(tmp_path / "s.ggsq"))
    assert restored.tokens == prompt


def test_a_request_pinned_to_a_busy_slot_does_not_block_the_queue():
    """Review finding: a pinned request queued behind a long one held every later request back."""
    engine = make_engine()
    long = engine.add_request([1, 2], SamplingParams.greedy(max_tokens=200, ignore_eos=True), slot=0)
    pinned = engine.add_request([3, 4], SamplingParams.greedy(max_tokens=2), slot=0)
    free = engine.add_request([5, 6], SamplingParams.greedy(max_tokens=2))
    done: dict = {}
    for _ in range(10):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert free in done and pinned not in done and long not in done
    assert engine.snapshot().waiting == 1
    engine.abort(long)
    done.update(run_all(engine))
    assert (
        done[pinned].error is None
        and done[pinned].outputs[0].token_ids == alone([3, 4], SamplingParams.greedy(max_tokens=2))[0]
    )


def test_a_request_aborted_while_its_state_is_replayed_caches_nothing_and_empties_its_session():
    """A suspect's sequence holds a partial replay: neither the prompt cache nor the session may claim
    the tokens it has not folded yet."""
    model = FaultyModel(toy())
    engine = make_engine(model, prompt_cache=True, max_batch_tokens=8)
    session = engine.open_session()
    engine.add_request([1, 2, 3], SamplingParams.greedy(max_tokens=3), session=session)
    run_all(engine)
    turn = engine.add_request([4, 5], SamplingParams.greedy(max_tokens=20), session=session)
    long = engine.add_request(list(range(10, 30)), SamplingParams.greedy(max_tokens=20), slot=CULPRIT_SLOT)
    for _ in range(4):  # both decoding
        engine.step()
    fired: list[frozenset[int]] = []
    model.raise_when(lambda seqs: not fired and (fired.append(seqs) or True))
    engine.step()  # the shared batch fails: both become suspects with replays planned
    assert fired and engine.requests[long].suspect
    engine.step()  # one suspect replays its first chunk (8 tokens of 20+)
    model.raise_when(None)
    assert engine.abort(long) and engine.abort(turn)
    run_all(engine)
    assert engine.pool.cached_tokens(CULPRIT_SLOT) == []
    assert engine.ctx.memory.seq_pos_max(CULPRIT_SLOT) == -1
    assert session.tokens == [] and session.pending == [] and not session.busy
    rid = engine.add_request([6, 7], SamplingParams.greedy(max_tokens=3), session=session)
    assert [c.token_ids for c in run_all(engine)[rid].outputs] == alone(
        [6, 7], SamplingParams.greedy(max_tokens=3)
    )
