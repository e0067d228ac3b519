"""One engine loop for every connection: a thread owns the engine, the event loop talks to it.

The engine is not thread-safe, so every access goes through :meth:`EngineRunner.call`, which queues a
function for the engine thread and awaits its result. Between engine steps the thread runs those
commands; each step's reports are handed to the per-request asyncio queues of the listeners.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import uuid
from collections.abc import Callable
from typing import TypeVar

from rsmem.engine import Engine, RequestOutput, SamplingParams

T = TypeVar("T")


class QueueFullError(Exception):
    """Every slot is busy and the waiting queue is at its bound."""


class EngineRunner:
    def __init__(self, engine: Engine, *, max_queue: int = 64) -> None:
        self.engine = engine
        self.max_queue = max_queue
        self._commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._listeners: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[RequestOutput]]] = {}
        self._thread = threading.Thread(target=self._loop, name="rsmem-engine", daemon=True)
        self._stopping = False
        self.error: BaseException | None = None

    # ----------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        self._thread.join(timeout=10)

    def _loop(self) -> None:
        while not self._stopping:
            while True:
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    break
                command()
            if self.engine.has_unfinished:
                try:
                    outputs = self.engine.step()
                except BaseException as exc:  # a model bug must not hang every client
                    self.error = exc
                    for rid in list(self.engine.requests):
                        self.engine.abort(rid)
                    outputs = self.engine.step()
                for out in outputs:
                    listener = self._listeners.get(out.request_id)
                    if listener is not None:
                        loop, q = listener
                        loop.call_soon_threadsafe(q.put_nowait, out)
                    if out.finished:
                        self._listeners.pop(out.request_id, None)
            else:
                self._wake.wait(timeout=0.1)
                self._wake.clear()

    # ------------------------------------------------------------- commands

    async def call(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the engine thread between steps and return its result (or raise its error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[T] = loop.create_future()

        def command() -> None:
            try:
                result = fn()
            except BaseException as exc:
                loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                loop.call_soon_threadsafe(_set_result, future, result)

        self._commands.put(command)
        self._wake.set()
        return await future

    async def submit(
        self, prompt: str | list[int], params: SamplingParams, *, slot: int | None = None
    ) -> tuple[str, asyncio.Queue[RequestOutput]]:
        """Queue a request; returns its id and the queue its reports arrive on."""
        request_id = f"cmpl-{uuid.uuid4().hex[:24]}"
        reports: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._listeners[request_id] = (asyncio.get_running_loop(), reports)

        def add() -> str:
            queued = sum(r.params.n for r in self.engine.waiting) - len(self.engine.free_seqs)
            if queued + params.n > self.max_queue:
                raise QueueFullError(
                    f"all {self.engine.ctx.n_seq_max} slots are busy and {max(queued, 0)} requests wait"
                )
            return self.engine.add_request(prompt, params, request_id=request_id, slot=slot)

        try:
            await self.call(add)
        except BaseException:
            self._listeners.pop(request_id, None)
            raise
        return request_id, reports

    async def abort(self, request_id: str) -> None:
        self._listeners.pop(request_id, None)
        await self.call(lambda: self.engine.abort(request_id))

    def abort_nowait(self, request_id: str) -> None:
        """Cancel from any thread or a finally block, without waiting (a client went away)."""
        self._listeners.pop(request_id, None)
        self._commands.put(lambda: self.engine.abort(request_id))
        self._wake.set()


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
