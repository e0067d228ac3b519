"""Waiting for a submission's reports: all at once (a JSON answer) or as they come (server-sent events).

Either way a client that goes away cancels its requests at once, whether they are queued, prefilling
or decoding: the JSON path watches the ASGI receive channel for ``http.disconnect`` while it waits;
the streaming path is cancelled by Starlette's own disconnect listener. Requests that did not finish
are aborted in a ``finally``, so no exit path leaves one generating.

Failures (a completion that finished with ``"error"``, or an engine step that raised): a request of
several completions (``n > 1``) or several prompts fails as a whole, even if only one completion
failed. OpenAI's protocol has no per-choice error, and a partial set of choices would look like a
success to a client; so the first failure aborts the request's other completions and the answer is
the error object (400 for a request's own fault, 500 for the model's), or, in a stream, a final
``data: {"error": {...}}`` event followed by ``data: [DONE]``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any, Protocol

from fastapi import Request

from rsmem.engine import RequestOutput
from rsmem.server.errors import ApiError
from rsmem.server.responses import failure_of
from rsmem.server.runner import EngineRunner, Report, Submission


class ClientGoneError(ApiError):
    """The client disconnected before its answer was ready (nobody reads this 499)."""

    def __init__(self) -> None:
        message = "the client disconnected; its request was cancelled"
        super().__init__(499, message, code="client_disconnected")


class ChunkFormat(Protocol):
    def opening(self) -> list[dict[str, Any]]: ...

    def chunks(self, out: RequestOutput) -> list[dict[str, Any]]: ...

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> dict[str, Any]: ...


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client has gone away (the body was read already, so only ``http.disconnect``
    can come on the channel)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def collect(request: Request, runner: EngineRunner, sub: Submission) -> list[RequestOutput]:
    """The final reports of every request of ``sub``, in submission order.

    Raises :class:`ClientGoneError` if the client disconnects first, the failure's :class:`ApiError`
    if a request fails; in both cases every unfinished request of ``sub`` is aborted."""
    finals: dict[str, RequestOutput] = {}
    gone = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        while len(finals) < len(sub.request_ids):
            report = asyncio.ensure_future(sub.reports.get())
            done, _ = await asyncio.wait({report, gone}, return_when=asyncio.FIRST_COMPLETED)
            if report not in done:
                report.cancel()
                raise ClientGoneError()
            out = report.result()
            failure = failure_of(out)
            if failure is not None:
                raise failure
            assert isinstance(out, RequestOutput)
            if out.finished:
                finals[out.request_id] = out
    finally:
        gone.cancel()
        unfinished = [rid for rid in sub.request_ids if rid not in finals]
        if unfinished:
            runner.abort_nowait(unfinished)
    return [finals[rid] for rid in sub.request_ids]


async def reports_ready(sub: Submission) -> list[Report]:
    """The next report of ``sub`` and every one queued behind it (the engine thread hands several
    steps' reports over at once; a stream that fell behind catches up in one write)."""
    ready = [await sub.reports.get()]
    while not sub.reports.empty():
        ready.append(sub.reports.get_nowait())
    return ready


def sse(obj: dict[str, Any] | str) -> bytes:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()


async def stream_events(
    runner: EngineRunner, sub: Submission, fmt: ChunkFormat, *, include_usage: bool
) -> AsyncIterator[bytes]:
    """Server-sent events of ``sub``'s reports; ends with the usage chunk (when asked) and ``[DONE]``.

    A failure ends the stream with one ``{"error": ...}`` event and ``[DONE]``; the client leaving
    cancels this generator, whose ``finally`` aborts what did not finish."""
    finals: dict[str, RequestOutput] = {}
    try:
        opening = fmt.opening()  # completions' echoed prompts
        if opening:
            yield b"".join(map(sse, opening))
        while len(finals) < len(sub.request_ids):
            events: list[bytes] = []
            for out in await reports_ready(sub):  # one write for all the reports that wait
                failure = failure_of(out)
                if failure is not None:
                    yield b"".join([*events, sse(failure.body()), sse("[DONE]")])
                    return
                assert isinstance(out, RequestOutput)
                events += map(sse, fmt.chunks(out))
                if out.finished:
                    finals[out.request_id] = out
            if events:
                yield b"".join(events)
        if include_usage:
            yield sse(fmt.usage_chunk([finals[rid] for rid in sub.request_ids]))
        yield sse("[DONE]")
    finally:
        unfinished = [rid for rid in sub.request_ids if rid not in finals]
        if unfinished:
            runner.abort_nowait(unfinished)
