"""One engine loop for every connection: a thread owns the engine, the event loop talks to it.

The engine is not thread-safe, so every access goes through :meth:`EngineRunner.call`, which queues a
function for the engine thread and awaits its result. Between engine steps the thread runs those
commands (a new request never waits for more than the step in progress); the steps' reports go to the
asyncio queue of the HTTP request that submitted them.

Reports are handed to the event loop in one hand-off for all streams, at most every ``flush_interval``
seconds: each hand-off wakes the loop, which then holds the GIL the engine thread needs (on a small
model a step is short, and waking the loop every step would take a real share of the engine's time).
A report that carries a request's first token or first text, or ends it, goes at once (time to first
token and the end of a request are never held back), and so does everything held once the engine has
nothing left to run.

``Engine.step()`` does not raise for a request's or the model's fault (it fails the requests
concerned). Should it raise anyway, the runner fails only the requests in flight (it aborts them and
sends each listener a :class:`StepFailure`), logs one line, and goes on serving: there is no
permanent failure state.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from rsmem.engine import Engine, RequestOutput, SamplingParams
from rsmem.engine.status import EngineSnapshot
from rsmem.errors import InvalidRequestError

T = TypeVar("T")
log = logging.getLogger("rsmem.server")


class QueueFullError(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


class EngineStoppedError(RuntimeError):
    """The engine thread is not running (stopped, or never started)."""


@dataclass(frozen=True, slots=True)
class StepFailure:
    """Sent to a request's listener when ``engine.step()`` raised: the request was aborted."""

    message: str


Report = RequestOutput | StepFailure


@dataclass(frozen=True, slots=True)
class Submission:
    """Requests submitted together (one HTTP request); their reports all arrive on ``reports``."""

    request_ids: tuple[str, ...]
    reports: asyncio.Queue[Report]


_Outcome = tuple[asyncio.Future[Any], BaseException | None, object]  # a command's future, error, result


@dataclass(slots=True)
class _Command:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop | None  # None: fire and forget
    future: asyncio.Future[Any] | None

    def run(self) -> tuple[BaseException | None, object]:
        """``(error, None)`` or ``(None, result)`` of ``fn``; a fire-and-forget command's error is logged."""
        try:
            return None, self.fn()
        except Exception as exc:
            if self.future is None:
                log.error("engine command failed: %s: %s", type(exc).__name__, exc)
            return exc, None

    def settle(self, exc: BaseException | None, result: object) -> None:
        if self.loop is not None and self.future is not None:
            _hand_over(self.loop, [(self.future, exc, result)])


class EngineRunner:
    def __init__(self, engine: Engine, *, max_queue: int = 64, flush_interval: float = 0.01) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self.flush_interval = flush_interval
        self._held: list[RequestOutput] = []  # reports not handed to their listeners yet (engine thread)
        self._held_since = 0.0
        self.n_slots = engine.snapshot().n_slots  # read before the engine thread exists
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._wake = threading.Event()
        # request id -> (loop, queue); touched only on the engine thread
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Report]]] = {}
        self._thread = threading.Thread(target=self._loop, name="rsmem-engine", daemon=True)
        self._stopping = False

    # ----------------------------------------------------------- lifecycle

    def start(self) -> None:
        """Start the engine thread (once; later calls do nothing)."""
        if not self._thread.is_alive() and not self._stopping and self._thread.ident is None:
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    @property
    def in_flight(self) -> int:
        """Requests submitted through this runner that have not finished yet."""
        return len(self._listeners)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is left, stop the thread, and fail every command still queued."""
        if self._thread.is_alive():
            self._commands.put(_Command(self._abort_all, None, None))
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout=timeout)
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            command.settle(EngineStoppedError("the engine is stopping"), None)

    def _loop(self) -> None:
        while not self._stopping:
            self._run_commands()
            if self.engine.has_unfinished:
                self._step()
            else:
                self._wake.wait(timeout=0.1)
                self._wake.clear()
        self._run_commands()
        self._flush()

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:
            self._flush()  # what earlier steps reported comes before the failure
            self._fail_in_flight(exc)
            time.sleep(0.01)  # never spin if the engine keeps raising
            return
        now = time.monotonic()
        if not self._held:
            self._held_since = now
        self._held += outputs
        if (
            now - self._held_since >= self.flush_interval
            or any(map(_urgent, outputs))
            or not self.engine.has_unfinished
        ):
            self._flush()

    def _flush(self) -> None:
        held, self._held = self._held, []
        if held:
            self._deliver((out.request_id, out, out.finished) for out in held)

    def _run_commands(self) -> None:
        """Run every queued command, then settle their futures with one hand-off to each waiting loop (a
        burst of requests arriving during a step costs the event loop one wake-up, not one each)."""
        settled: dict[asyncio.AbstractEventLoop, list[_Outcome]] = {}
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
            exc, result = command.run()
            if command.loop is not None and command.future is not None:
                settled.setdefault(command.loop, []).append((command.future, exc, result))
        for loop, outcomes in settled.items():
            _hand_over(loop, outcomes)

    def _deliver(self, reports: Iterable[tuple[str, Report, bool]]) -> None:
        """Hand ``(request id, report, final)`` to their listeners: one hand-off to each listening loop,
        not one a report. Requests whose loop is gone are aborted (nobody will read them)."""
        batches: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue[Report], Report]]] = {}
        for rid, report, final in reports:
            listener = self._listeners.pop(rid, None) if final else self._listeners.get(rid)
            if listener is not None:
                batches.setdefault(listener[0], []).append((rid, listener[1], report))
        for loop, items in batches.items():
            try:
                loop.call_soon_threadsafe(_put_all, [(queue_, report) for _, queue_, report in items])
            except RuntimeError:
                for rid, _, _ in items:
                    self._listeners.pop(rid, None)
                    self.engine.abort(rid)

    def _fail_in_flight(self, exc: Exception) -> None:
        message = f"the engine failed: {type(exc).__name__}: {exc}"
        ids = list(self._listeners)
        log.error("%s; aborted %d request(s) in flight, serving on", message, len(ids))
        for rid in ids:
            with contextlib.suppress(Exception):  # already broken for this request: tell its client
                self.engine.abort(rid)
        self._deliver((rid, StepFailure(message), True) for rid in ids)

    def _abort_all(self) -> int:
        ids = list(self._listeners)
        for rid in ids:
            self.engine.abort(rid)
        self._step()  # hands the final "abort" reports to their listeners
        return len(ids)

    # ------------------------------------------------------------- commands

    async def call(self, fn: Callable[[], T], *, timeout: float | None = None) -> T:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its error)."""
        if not self.alive:
            raise EngineStoppedError("the engine thread is not running")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()
        self._commands.put(_Command(fn, loop, future))
        self._wake.set()
        if timeout is None:
            return await future
        return await asyncio.wait_for(future, timeout)

    def post(self, fn: Callable[[], object]) -> None:
        """Run ``fn`` on the engine thread without waiting (safe from a ``finally`` of a cancelled task)."""
        self._commands.put(_Command(fn, None, None))
        self._wake.set()

    async def snapshot(self, *, timeout: float | None = None) -> EngineSnapshot:
        return await self.call(self.engine.snapshot, timeout=timeout)

    async def submit(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams,
        *,
        slot: int | None = None,
        id_prefix: str = "cmpl",
        boundaries: Sequence[int] = (),
    ) -> Submission:
        """Queue several prompts together (checked by the engine, all or none); returns their ids
        (``{prefix}-{hex}``, with ``-{k}`` per prompt when there are several) and their report queue.

        Raises :class:`QueueFullError` when the waiting sequences would exceed ``max_queue``, and the
        engine's :class:`~rsmem.errors.InvalidRequestError` for an invalid request.
        """
        base = f"{id_prefix}-{_ids.getrandbits(96):024x}"
        ids = (base,) if len(prompts) == 1 else tuple(f"{base}-{k}" for k in range(len(prompts)))
        reports: asyncio.Queue[Report] = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def add() -> None:
            n_slots, free, waiting = self.engine.capacity()
            queued = waiting - free
            needed = params.n * len(prompts)
            if needed > n_slots + self.max_queue:  # could never be accepted: not "busy"
                raise InvalidRequestError(
                    "prompt",
                    f"asks for {needed} completions ({len(prompts)} prompts, n = {params.n}): more than "
                    f"the {n_slots} slots and {self.max_queue} queue places of this server",
                )
            if queued + needed > self.max_queue:
                raise QueueFullError(f"all {n_slots} slots are busy and {max(queued, 0)} requests wait")
            if len(prompts) == 1:  # add_requests would name it "prompt 0" in its errors
                self.engine.add_request(prompts[0], params, ids[0], slot=slot, boundaries=boundaries)
            else:
                self.engine.add_requests(list(prompts), params, request_ids=ids, slot=slot)
            for rid in ids:
                self._listeners[rid] = (loop, reports)

        await self.call(add)
        return Submission(ids, reports)

    async def abort(self, request_ids: Sequence[str]) -> None:
        await self.call(lambda: self._abort(request_ids))

    def abort_nowait(self, request_ids: Sequence[str]) -> None:
        """Cancel from a ``finally`` block or another thread, without waiting (a client went away)."""
        self.post(lambda: self._abort(request_ids))

    def _abort(self, request_ids: Sequence[str]) -> None:
        for rid in request_ids:
            self._listeners.pop(rid, None)
            self.engine.abort(rid)

    async def abort_all(self) -> int:
        """Abort every request in flight (graceful shutdown past its timeout); returns how many.

        Their listeners get the final ``abort`` reports, so their clients still get an answer."""
        return await self.call(self._abort_all)


# Request ids: 96 random bits from a generator seeded once. uuid4() reads os.urandom for each id, a system
# call that gives the GIL away on the event loop, and a busy engine thread may keep it for a switch interval
# (``sys.getswitchinterval()``) before the request goes on. Ids need to be unique, not secret.
_ids = random.Random(os.urandom(32))


def _urgent(out: RequestOutput) -> bool:
    """The report ends its request, or carries a completion's first token or first text."""
    return out.finished or any(
        (c.token_ids and len(c.delta_token_ids) == len(c.token_ids))
        or (c.delta_text and len(c.delta_text) == len(c.text))
        for c in out.outputs
    )


def _put_all(items: list[tuple[asyncio.Queue[Report], Report]]) -> None:
    for reports, report in items:
        reports.put_nowait(report)


def _hand_over(loop: asyncio.AbstractEventLoop, outcomes: list[_Outcome]) -> None:
    with contextlib.suppress(RuntimeError):  # a closed loop: nobody is waiting any more
        loop.call_soon_threadsafe(_settle_all, outcomes)


def _settle_all(outcomes: list[_Outcome]) -> None:
    for future, exc, result in outcomes:
        if future.done():  # cancelled by its caller (a timeout, a client that left)
            continue
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)
