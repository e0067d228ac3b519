"""Concurrent ``LLM`` streams: each equals its request run alone, whoever steps the engine."""

from __future__ import annotations

import asyncio
import itertools
import threading

import pytest
from test_engine import byte_tokenizer

from rsmem.engine import LLM, RequestOutput, SamplingParams
from rsmem.models import DecayedSumModel

PROMPTS = ["HAMLET:", "ROMEO:", "a", "to be or", "JULIET: ", "xyz", "Enter KING", "Q"]


def make_llm(n_seq_max: int = 8) -> LLM:
    model = DecayedSumModel(n_vocab=257, n_embd=6, n_layer=2, seed=3)
    return LLM(model, tokenizer=byte_tokenizer(), n_seq_max=n_seq_max)


def params(k: int) -> SamplingParams:
    # seeded sampling: each request's text is fixed by its seed, so a report routed to the wrong
    # stream (or lost) changes it; lengths differ so streams end at different steps
    return SamplingParams(temperature=0.9, seed=100 + k, max_tokens=8 + 3 * k, ignore_eos=True)


@pytest.fixture(scope="module")
def solo() -> list[RequestOutput]:
    """Each prompt's output from an LLM running it alone."""
    return [make_llm().generate(p, params(k))[0] for k, p in enumerate(PROMPTS)]


def check_stream(reports: list[RequestOutput], alone: RequestOutput) -> None:
    """A stream's reports: one request's, the last one finished, the deltas adding up to its text."""
    assert {r.request_id for r in reports} == {reports[0].request_id}
    assert reports[-1].finished and not any(r.finished for r in reports[:-1])
    assert "".join(r.outputs[0].delta_text for r in reports) == alone.text
    assert reports[-1].outputs[0].token_ids == alone.outputs[0].token_ids


def test_interleaved_sync_streams_equal_their_solo_runs(solo: list[RequestOutput]) -> None:
    llm = make_llm()
    streams = [llm.stream(p, params(k)) for k, p in enumerate(PROMPTS)]
    got: list[list[RequestOutput]] = [[] for _ in PROMPTS]
    for step in itertools.zip_longest(*streams):
        for k, out in enumerate(step):
            if out is not None:
                got[k].append(out)
    for reports, alone in zip(got, solo):
        check_stream(reports, alone)
    assert llm.context.memory.used == 0


def test_concurrent_astreams_equal_their_solo_runs(solo: list[RequestOutput]) -> None:
    llm = make_llm()

    async def collect(k: int) -> list[RequestOutput]:
        return [out async for out in llm.astream(PROMPTS[k], params(k))]

    async def main() -> list[list[RequestOutput]]:
        return await asyncio.gather(*(collect(k) for k in range(len(PROMPTS))))

    for reports, alone in zip(asyncio.run(main()), solo):
        check_stream(reports, alone)
    assert llm.context.memory.used == 0


def test_streams_from_threads_and_generate_at_once(solo: list[RequestOutput]) -> None:
    """Streams on their own threads and a ``generate`` call share one engine; each gets its own."""
    llm = make_llm()
    got: dict[int, list[RequestOutput]] = {}

    def consume(k: int) -> None:
        got[k] = list(llm.stream(PROMPTS[k], params(k)))

    threads = [threading.Thread(target=consume, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    rest = llm.generate(PROMPTS[4:], [params(k) for k in range(4, len(PROMPTS))])
    for t in threads:
        t.join(timeout=60)
        assert not t.is_alive()
    for k in range(4):
        check_stream(got[k], solo[k])
    assert [o.outputs[0].token_ids for o in rest] == [o.outputs[0].token_ids for o in solo[4:]]


def test_a_stream_closed_early_leaves_the_others_whole(solo: list[RequestOutput]) -> None:
    llm = make_llm()
    first, second = llm.stream(PROMPTS[0], params(0)), llm.stream(PROMPTS[1], params(1))
    next(first)
    reports = [next(second)]
    first.close()  # aborted: its sequence is freed, the other stream goes on
    reports += list(second)
    check_stream(reports, solo[1])
    assert llm.context.memory.used == 0
