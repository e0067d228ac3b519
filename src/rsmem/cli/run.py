"""Driving the engine from a terminal: streaming one request, Ctrl-C, progress and speed lines.

Ctrl-C never interrupts an engine step. While a request streams, SIGINT (and SIGTERM, where the command
treats it as Ctrl-C) only sets a flag (:class:`Interrupt`) that the step loop reads between steps; the
request is then aborted through ``engine.abort``, which leaves the engine (and a session's state)
consistent, so it can be saved.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import TYPE_CHECKING, TextIO

from rsmem.errors import RsmemError

if TYPE_CHECKING:
    from rsmem.engine import Engine, RequestOutput, Session

PROGRESS_MIN_TOKENS = 256  # show prefill progress for prompts at least this long


class Progress:
    """Status on stderr (only when stderr is a terminal, unless ``enabled``): one self-overwriting line on
    a terminal, plain lines elsewhere (a log, a pipe), which no escape codes garble."""

    def __init__(self, stream: TextIO | None = None, enabled: bool | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.terminal = self.stream.isatty()
        self.enabled = self.terminal if enabled is None else enabled
        self._shown = False

    def update(self, text: str) -> None:
        if not self.enabled:
            return
        if self.terminal:
            self.stream.write(f"\r\033[K{text}")
            self._shown = True
        else:
            self.stream.write(f"{text}\n")
        self.stream.flush()

    def done(self) -> None:
        if self._shown:
            self.stream.write("\r\033[K")
            self.stream.flush()
            self._shown = False


def report_speed(engine: Engine, wall: float) -> None:
    """The statistics line on stderr: prompt and generated tokens, tokens per second over ``wall``
    seconds (the time spent generating)."""
    s = engine.stats
    sys.stderr.write(
        f"[{s.prompt_tokens} prompt tokens, {s.generated_tokens} generated in {wall:.2f}s: "
        f"{s.generated_tokens / wall if wall else 0:.1f} tok/s generated, "
        f"{(s.prompt_tokens + s.generated_tokens) / wall if wall else 0:.1f} tok/s total]\n"
    )


class Interrupt:
    """Within ``with Interrupt() as stop:``, Ctrl-C (and SIGTERM, with ``terminate``) sets
    ``stop.requested`` instead of raising; ``stop.signum`` is the first signal, ``stop.exit_code`` what
    the command then exits with (128 + it, as a shell reports a program the signal ended).

    With ``second_raises``, a second signal before the first was handled ends the program (a way out if
    something hangs): a Ctrl-C raises ``KeyboardInterrupt``, a SIGTERM kills as SIGTERM does. Outside the
    main thread signals cannot be caught: it does nothing.
    """

    def __init__(self, *, second_raises: bool = False, terminate: bool = False) -> None:
        self.signum: int | None = None
        self.second_raises = second_raises
        self.signals = (signal.SIGINT, signal.SIGTERM) if terminate else (signal.SIGINT,)
        self._previous: dict[int, Callable[[int, FrameType | None], object] | int | None] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def exit_code(self) -> int:
        return 128 + (self.signum or signal.SIGINT)

    def __enter__(self) -> Interrupt:
        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested and self.second_raises:
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        if self.signum is None:
            self.signum = signum


class Terminated(BaseException):
    """SIGTERM, raised where nothing runs in the engine (see :func:`sigterm_raises`)."""


@contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` while the block runs (in the main thread; an
    :class:`Interrupt` inside it takes SIGTERM over while it is active), so a command can still save
    and report: for the time spent waiting for input, where no engine step can be cut."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum: int, frame: FrameType | None) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@dataclass(slots=True)
class Streamed:
    """How a streamed request ended: its last report (None if none came) and whether Ctrl-C cut it."""

    last: RequestOutput | None
    interrupted: bool


def stream_request(
    engine: Engine,
    request_id: str,
    on_text: Callable[[str], None],
    interrupt: Interrupt,
    progress: Progress | None = None,
) -> Streamed:
    """Step the engine until ``request_id`` finishes, passing its new text to ``on_text``; show prefill
    progress for long prompts. On Ctrl-C (``interrupt.requested``) the request is aborted.

    A request the engine failed raises :class:`RsmemError` with the engine's message.
    """
    progress = progress or Progress()
    last: RequestOutput | None = None
    try:
        while not interrupt.requested:
            _show_prefill(engine, request_id, progress)
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                progress.done()
                on_text(out.outputs[0].delta_text)
                last = out
            if last is not None and last.finished:
                _raise_if_failed(last)
                return Streamed(last, interrupted=False)
            if not engine.has_unfinished:
                raise RsmemError(f"request {request_id} ended without a final report")
    finally:
        progress.done()
    engine.abort(request_id)
    return Streamed(last, interrupted=True)


def note_context_full(streamed: Streamed, max_tokens: int | None) -> None:
    """Say so on stderr when a reply ended short of ``max_tokens`` (None: no limit) because the sequence's
    context is full (a hybrid model's KV cells: the engine caps the reply there)."""
    last = streamed.last
    if streamed.interrupted or last is None or last.outputs[0].finish_reason != "length":
        return
    if max_tokens is None or len(last.outputs[0].token_ids) < max_tokens:
        sys.stderr.write("[the context is full: the sequence's KV cells hold no more tokens (-c)]\n")


def _show_prefill(engine: Engine, request_id: str, progress: Progress) -> None:
    done_total = engine.request_progress(request_id)
    if done_total is not None:
        done, total = done_total
        if total >= PROGRESS_MIN_TOKENS and done < total:
            progress.update(f"prefill {done}/{total} tokens")


def _raise_if_failed(out: RequestOutput) -> None:
    if out.outputs[0].finish_reason == "error":
        raise RsmemError(f"generation failed: {out.error or out.outputs[0].error or 'unknown error'}")


def save_state(engine: Engine, session: Session, path: str) -> int:
    """``engine.save_session`` for ``--save-state``; a write error names the flag and the path as typed
    (never the temporary file the atomic write goes through)."""
    try:
        return engine.save_session(session, path)
    except OSError as exc:
        raise RsmemError(f"--save-state {path}: {exc.strerror or exc}") from None


def write_out(text: str) -> None:
    """Stream generated text to stdout now."""
    sys.stdout.write(text)
    sys.stdout.flush()


def open_session(engine: Engine, load_state: str | None) -> Session:
    """A session, restored from ``--load-state`` when given; a file that does not load names the flag."""
    from rsmem.errors import StateFormatError

    try:
        return engine.open_session(load_state)
    except StateFormatError as exc:
        raise RsmemError(f"--load-state {load_state}: {exc}") from exc
