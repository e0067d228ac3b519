"""The engine thread: no permanent failure state, and ``/health`` from the snapshot and the thread."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from helpers.server import MODEL, LiveServer, start_server

pytestmark = pytest.mark.subprocess


def complete(live: LiveServer, **extra) -> httpx.Response:
    payload = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 8, "temperature": 0} | extra
    return httpx.post(f"{live.base_url}/completions", json=payload, timeout=60)


def test_a_step_that_raises_fails_only_the_requests_in_flight(shared_llm):
    """``Engine.step`` should never raise; if it does, the requests in flight fail and serving goes on."""
    with start_server(shared_llm, max_tokens_limit=None) as live:
        want = complete(live).json()["choices"][0]["text"]
        engine = live.engine
        real_step = engine.step
        armed = threading.Event()

        def step():  # raises once, when armed
            if armed.is_set():
                armed.clear()
                raise RuntimeError("boom")
            return real_step()

        engine.step = step  # type: ignore[method-assign]
        try:
            results: list[httpx.Response] = []
            eos = engine.tokenizer.eos_token_id
            long = {"max_tokens": 100_000, "logit_bias": {str(eos): -100}}
            thread = threading.Thread(target=lambda: results.append(complete(live, **long)))
            thread.start()
            deadline = time.monotonic() + 10
            while not live.snapshot()["rsmem_requests_running"]:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            armed.set()
            thread.join(timeout=30)
            failed = results[0]
            assert failed.status_code == 500
            assert failed.json()["error"]["type"] == "server_error"
            assert "boom" in failed.json()["error"]["message"]

            payload = {"model": MODEL, "prompt": "ROMEO:", "stream": True, **long}
            with httpx.stream("POST", f"{live.base_url}/completions", json=payload, timeout=30) as r:
                lines = (line[6:] for line in r.iter_lines() if line.startswith("data: "))
                events = [next(lines)]
                armed.set()  # a stream in flight ends with an error event
                events += list(lines)
            assert events[-1] == "[DONE]" and "boom" in json.loads(events[-2])["error"]["message"]
        finally:
            del engine.step
        live.wait_idle()
        assert live.runner.alive
        assert complete(live).json()["choices"][0]["text"] == want  # later requests are served
        assert httpx.get(f"{live.url}/health").json()["status"] == "ok"


def test_health_reports_slots_from_the_snapshot(live):
    body = httpx.get(f"{live.url}/health").json()
    assert body == {"status": "ok", "reason": None, "slots_idle": 4, "slots_processing": 0}


def test_health_is_503_when_the_engine_thread_is_gone(shared_llm):
    with start_server(shared_llm) as live:
        live.runner.stop()
        r = httpx.get(f"{live.url}/health")
        assert r.status_code == 503
        assert r.json()["status"] == "error" and "not running" in r.json()["reason"]
        r = complete(live)
        assert r.status_code == 503 and r.json()["error"]["code"] == "engine_stopped"


def stream_raw(live: LiveServer, **extra) -> list[bytes]:
    payload = {"model": MODEL, "prompt": "ROMEO:", "temperature": 0, "stream": True} | extra
    with httpx.stream("POST", f"{live.base_url}/completions", json=payload, timeout=60) as r:
        return list(r.iter_raw())


def events_of(raw: list[bytes]) -> list[object]:
    """The events' choices (or the final ``[DONE]``)."""
    lines = [line[6:] for line in b"".join(raw).decode().split("\n") if line.startswith("data: ")]
    return [line if line == "[DONE]" else json.loads(line)["choices"] for line in lines]


def test_reports_between_the_first_token_and_the_end_are_handed_over_together(shared_llm):
    """The engine thread holds reports for up to ``flush_interval`` (one hand-off to the event loop for
    several steps), but never a request's first token or its end; the stream still has one event a
    token, and the held ones go out in one write."""
    with start_server(shared_llm) as live:
        eos = live.engine.tokenizer.eos_token_id
        body = {"max_tokens": 24, "logit_bias": {str(eos): -100}}
        every_step = events_of(stream_raw(live, **body))
        live.runner.flush_interval = 3600.0  # hold everything that is not urgent
        raw = stream_raw(live, **body)
    held = events_of(raw)
    assert held == every_step  # the same events (one a token), in the same order
    assert len([e for e in held if e != "[DONE]"]) == 24
    first = events_of(raw[:1])
    assert len(first) == 1 and first[0][0]["finish_reason"] is None  # type: ignore[index]  # not held
    assert len(raw) <= 3  # the first token; the other 23, the end and [DONE] in one write (or two)


def test_request_ids_need_no_system_call(shared_llm, monkeypatch):
    """Ids come without os.urandom on the event loop (a system call gives its GIL away to the engine thread);
    they keep their form ``{prefix}-{24 hex}`` and stay unique."""
    import asyncio
    import os
    import re

    from rsmem.engine import Engine, SamplingParams
    from rsmem.server import EngineRunner

    runner = EngineRunner(Engine(shared_llm.context, shared_llm.tokenizer), max_queue=64)
    runner.start()

    real_urandom = os.urandom

    def no_urandom(n: int) -> bytes:  # on the event loop's thread (the engine thread may seed sampling)
        assert threading.current_thread() is not threading.main_thread(), "os.urandom on the event loop"
        return real_urandom(n)

    async def submit_all() -> list[str]:
        params = SamplingParams(max_tokens=1, temperature=0)
        subs = [await runner.submit(["ROMEO:"], params) for _ in range(6)]
        subs.append(await runner.submit(["ROMEO:", "JULIET:"], params, id_prefix="chatcmpl"))
        for sub in subs:  # every request ends
            finished = 0
            while finished < len(sub.request_ids):
                finished += (await sub.reports.get()).finished
        return [rid for sub in subs for rid in sub.request_ids]

    try:
        with monkeypatch.context() as m:
            m.setattr(os, "urandom", no_urandom)
            ids = asyncio.run(submit_all())
    finally:
        runner.stop()
    assert len(set(ids)) == len(ids) == 8
    assert all(re.fullmatch(r"cmpl-[0-9a-f]{24}", rid) for rid in ids[:6])
    base = ids[6].removesuffix("-0")
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{24}", base) and ids[7] == f"{base}-1"


def test_commands_queued_during_a_step_are_settled_in_one_hand_off(shared_llm):
    """Requests that arrive while the engine thread is busy wake the event loop once when they are run,
    not once each; each still gets its own result or error."""
    import asyncio

    from rsmem.engine import Engine
    from rsmem.server import EngineRunner

    runner = EngineRunner(Engine(shared_llm.context, shared_llm.tokenizer))
    runner.start()
    busy, release = threading.Event(), threading.Event()

    def block() -> None:  # holds the engine thread as a long step would
        busy.set()
        release.wait(10)

    def fail() -> None:
        raise ValueError("bad")

    async def burst() -> tuple[list[object], int]:
        loop = asyncio.get_running_loop()
        handed, real = [0], loop.call_soon_threadsafe

        def counting(*args):  # type: ignore[no-untyped-def]
            handed[0] += 1
            return real(*args)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        runner.post(block)
        while not busy.is_set():
            await asyncio.sleep(0.001)
        calls = [asyncio.ensure_future(runner.call(lambda k=k: k * k)) for k in range(8)]
        calls.append(asyncio.ensure_future(runner.call(fail)))
        await asyncio.sleep(0.05)
        release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        return results, handed[0]

    try:
        results, handed = asyncio.run(burst())
    finally:
        runner.stop()
    assert results[:8] == [k * k for k in range(8)]
    assert isinstance(results[8], ValueError) and str(results[8]) == "bad"
    assert handed == 1, handed
