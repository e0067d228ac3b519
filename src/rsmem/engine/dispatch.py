"""One engine, many callers: each report goes to the caller waiting for its request.

An :class:`~rsmem.engine.engine.Engine` is not thread-safe, and one ``step()`` reports on every request
in the batch. :class:`Dispatcher` lets any number of streams (sync generators interleaved in one thread,
asyncio tasks, other threads) share it: whoever needs a report steps the engine under one lock, and the
reports of other requests wait in their own inboxes, in order, until their callers take them. Every
engine call goes through the lock, so the engine is driven by one thread at a time.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from typing import TypeVar

from rsmem.engine.engine import Engine
from rsmem.engine.request import RequestOutput

T = TypeVar("T")


class Dispatcher:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = threading.RLock()
        self._inbox: dict[str, deque[RequestOutput]] = {}

    def submit(self, add: Callable[[Engine], list[str]]) -> list[str]:
        """Queue requests with ``add(engine)`` (returns their ids) and open their inboxes, at once."""
        with self._lock:
            ids = add(self.engine)
            for rid in ids:
                self._inbox[rid] = deque()
            return ids

    def call(self, fn: Callable[[Engine], T]) -> T:
        """Run ``fn(engine)`` while no other caller steps the engine (sessions, snapshots)."""
        with self._lock:
            return fn(self.engine)

    def next_report(self, request_id: str) -> RequestOutput | None:
        """The next report of ``request_id``, stepping the engine until there is one; None once its
        finished report was taken (or it was never submitted)."""
        with self._lock:
            box = self._inbox.get(request_id)
            if box is None:
                return None
            while not box:
                if not self.engine.has_unfinished:
                    raise RuntimeError(f"request {request_id} is unknown to the engine (bookkeeping bug)")
                for out in self.engine.step():
                    inbox = self._inbox.get(out.request_id)
                    if inbox is not None:
                        inbox.append(out)
            out = box.popleft()
            if out.finished:
                del self._inbox[request_id]
            return out

    def reports(self, request_id: str) -> Iterator[RequestOutput]:
        """Every report of ``request_id`` up to its finished one."""
        while (out := self.next_report(request_id)) is not None:
            yield out

    def close(self, request_id: str) -> None:
        """The caller stops listening: the request is aborted (if it still runs) and its inbox dropped."""
        with self._lock:
            self._inbox.pop(request_id, None)
            self.engine.abort(request_id)
