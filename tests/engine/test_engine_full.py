"""Every sequence taken: further sessions and requests are refused or wait, and nothing spins."""

from __future__ import annotations

import pytest
from test_engine import make_engine

from rsmem.engine import LLM, FinishReason, SamplingParams
from rsmem.errors import InvalidRequestError, NoFreeSequenceError
from rsmem.models import DecayedSumModel


def drain(engine, most_steps: int = 500) -> dict:
    """Step until nothing is left, failing if that takes more than ``most_steps`` (a spin)."""
    final = {}
    for _ in range(most_steps):
        if not engine.has_unfinished:
            return final
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
    raise AssertionError(f"the engine still has work after {most_steps} steps")


def test_llm_generate_is_refused_when_sessions_hold_every_sequence() -> None:
    llm = LLM(DecayedSumModel(n_vocab=257, n_embd=6, n_layer=2, seed=3), n_seq_max=8)
    sessions = [llm.engine.open_session() for _ in range(8)]
    with pytest.raises(NoFreeSequenceError, match="sessions hold 8 of the 8"):
        llm.engine.open_session()
    with pytest.raises(InvalidRequestError, match="sessions hold 8 of the 8") as exc:
        llm.generate([1, 2, 3], SamplingParams(max_tokens=4))
    assert exc.value.param == "n"
    assert not llm.engine.has_unfinished
    llm.engine.close_session(sessions[0])
    (out,) = llm.generate([1, 2, 3], SamplingParams(max_tokens=4))
    assert out.outputs[0].finish_reason is FinishReason.LENGTH


def test_n_beyond_the_sequences_sessions_leave_is_refused() -> None:
    llm = LLM(DecayedSumModel(n_vocab=257, n_embd=6, n_layer=2, seed=3), n_seq_max=8)
    for _ in range(6):
        llm.engine.open_session()
    with pytest.raises(InvalidRequestError, match="= 4 completions need 4 sequences"):
        llm.generate([1, 2], SamplingParams(max_tokens=4, n=4))
    outs = llm.generate([1, 2], SamplingParams(max_tokens=4, n=2))
    assert len(outs[0].outputs) == 2


def test_a_request_stranded_by_sessions_opened_after_it_fails_instead_of_spinning() -> None:
    _, engine = make_engine(n_seq_max=4)
    rid = engine.add_request([5, 6, 7], SamplingParams(max_tokens=4, n=3))
    pinned = engine.add_request([5, 6], SamplingParams(max_tokens=4), slot=0)
    for _ in range(2):  # take sequences 0 and 1 before anything runs
        engine.open_session()
    final = drain(engine)
    assert final[rid].outputs[0].finish_reason is FinishReason.ERROR
    assert "needs 3 sequences, but sessions hold 2 of the 4" in (final[rid].error or "")
    assert final[pinned].outputs[0].finish_reason is FinishReason.ERROR
    assert "needs slot 0" in (final[pinned].error or "")
    assert engine.pool.n_free == 2


def test_every_sequence_taken_then_requests_wait_or_are_refused() -> None:
    _, engine = make_engine(n_seq_max=4)
    s1, s2 = engine.open_session(), engine.open_session()
    long = engine.add_request([1, 2, 3], SamplingParams(max_tokens=20, n=2, ignore_eos=True))
    engine.step()
    assert engine.pool.n_free == 0  # two sessions, two completions: every sequence is taken
    with pytest.raises(NoFreeSequenceError):
        engine.open_session()
    with pytest.raises(InvalidRequestError, match="= 3 completions need 3 sequences"):
        engine.add_request([1], SamplingParams(max_tokens=2, n=3))
    with pytest.raises(InvalidRequestError, match="is held by a session"):
        engine.add_request([1], SamplingParams(max_tokens=2), slot=s1.seq_id)
    waits = engine.add_request([4, 5], SamplingParams(max_tokens=3, n=2))  # waits for `long`'s sequences
    in_session = engine.add_request([9], SamplingParams(max_tokens=3), session=s2)  # runs in its own
    final = drain(engine)
    assert {final[r].outputs[0].finish_reason for r in (long, waits, in_session)} == {FinishReason.LENGTH}
    assert engine.pool.n_free == 2 and engine.pool.held == {s1.seq_id, s2.seq_id}


def test_a_stop_string_that_is_not_unicode_text_is_refused():
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(stop=("ok", "bad\udc80"))
    assert err.value.param == "stop" and "lone surrogate U+DC80" in str(err.value)
    assert SamplingParams(stop=("né€",)).stop == ("né€",)
