"""Building and running the server: what ``rsmem serve`` calls.

``run_server(llm, ServeOptions(...))`` binds the address first (a bad or busy address is one
:class:`~rsmem.errors.RsmemError`, before any banner), then serves until SIGINT or SIGTERM. On the
first signal it stops accepting connections, lets the requests in flight finish for up to
``shutdown_timeout`` seconds, cancels what is left (its clients get their answers so far, with
``finish_reason`` "abort"), writes one line, and returns 0. A second signal cancels at once; neither
prints a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path
from types import FrameType
from typing import TextIO

import uvicorn
from fastapi import FastAPI
from uvicorn.config import LOG_LEVELS

from rsmem.engine import LLM, Engine, default_model_path
from rsmem.errors import RsmemError
from rsmem.server.app import create_app
from rsmem.server.chat import ChatTemplate, load_chat_template
from rsmem.server.runner import EngineRunner
from rsmem.server.state import AppState, ServerSettings


@dataclass(slots=True)
class ServeOptions:
    """The ``rsmem serve`` flags (``parallel`` is the LLM's ``n_seq_max``: the caller builds the LLM)."""

    host: str = "127.0.0.1"
    port: int = 8080
    parallel: int = 8
    api_key: str | None = None
    slot_save_path: Path | None = None
    max_queue: int = 64
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = 4096
    max_tokens_limit: int | None = 4096
    alias: str | None = None
    no_prompt_cache: bool = False
    log_level: str = "warning"
    cors_origins: tuple[str, ...] = ()
    shutdown_timeout: float = 5.0
    cache_ram: int = 1024  # MiB of checkpoints in the prefix cache (0: none)
    checkpoint_interval: int = 256  # also checkpoint every this many prompt tokens (0: off)
    checkpoint_codec: str = "exact"
    cache_dir: Path | None = None  # keep the prefix cache's checkpoints there too, across restarts
    cache_disk: int = 4096  # MiB of checkpoint files in cache_dir
    prefill_cap: int | None = None  # prompt tokens a step while others run (None: learnt; 0: no cap)
    rollback_depth: int = 0  # the LLM's n_rs_seq (the caller builds the LLM): read for the check only
    model_path: Path | None = None  # the model file (names a request may use, chat template); None: embedded

    @classmethod
    def from_args(cls, args: object, **overrides: object) -> ServeOptions:
        """From an argparse namespace (``args.cors_origin`` for the repeatable ``--cors-origin``,
        ``args.model`` for the model path); attributes it lacks keep their defaults."""
        values: dict[str, object] = {}
        for f in fields(cls):
            if hasattr(args, f.name):
                values[f.name] = getattr(args, f.name)
        if getattr(args, "cors_origin", None):
            values["cors_origins"] = tuple(args.cors_origin)  # type: ignore[attr-defined]
        if getattr(args, "model", None):
            values["model_path"] = Path(args.model)  # type: ignore[attr-defined]
        values.update(overrides)
        for name in ("slot_save_path", "cache_dir"):
            if values.get(name) is not None:
                values[name] = Path(str(values[name]))
        return cls(**values)  # type: ignore[arg-type]

    def check(self) -> None:
        if self.log_level not in LOG_LEVELS:
            raise RsmemError(f"--log-level {self.log_level!r}: use one of {', '.join(LOG_LEVELS)}")
        if not 0 <= self.port <= 65535:
            raise RsmemError(f"--port {self.port}: a port is 0 to 65535")
        if self.cache_ram < 0:
            raise RsmemError(f"--cache-ram {self.cache_ram}: must be >= 0 (MiB; 0 turns the cache off)")
        if self.checkpoint_interval < 0:
            raise RsmemError(f"--checkpoint-interval {self.checkpoint_interval}: must be >= 0 (0: off)")
        if self.cache_disk < 0:
            raise RsmemError(f"--cache-disk {self.cache_disk}: must be >= 0 (MiB)")
        if self.cache_dir is not None and (self.no_prompt_cache or self.cache_ram == 0):
            raise RsmemError(
                "--cache-dir keeps the prefix cache: it needs --cache-ram > 0 and no --no-prompt-cache"
            )
        if self.checkpoint_codec not in ("exact", "bf16", "int8"):
            raise RsmemError(f"--checkpoint-codec {self.checkpoint_codec!r}: use exact, bf16 or int8")
        if self.shutdown_timeout < 0:
            raise RsmemError(f"--shutdown-timeout {self.shutdown_timeout}: must be >= 0")
        if self.prefill_cap is not None and self.prefill_cap < 0:
            raise RsmemError(f"--prefill-cap {self.prefill_cap}: must be >= 0 (0: no cap) or auto")
        if self.rollback_depth < 0:
            raise RsmemError(f"--rollback-depth {self.rollback_depth}: must be >= 0 (0: off)")


@dataclass(slots=True)
class ServerApp:
    app: FastAPI
    state: AppState

    @property
    def runner(self) -> EngineRunner:
        return self.state.runner


def build_app(llm: LLM, options: ServeOptions) -> ServerApp:
    """The app over a new engine on ``llm``'s context, with the limits and names of ``options``."""
    path = Path(options.model_path) if options.model_path is not None else default_model_path()
    tok = llm.tokenizer
    template = ChatTemplate(
        load_chat_template(path) if path.exists() else None,
        bos_token=tok.token_text(tok.bos_token_id) if tok and tok.bos_token_id is not None else "",
        eos_token=tok.token_text(tok.eos_token_id) if tok and tok.eos_token_id is not None else "",
    )
    slot_dir = options.slot_save_path
    if slot_dir is not None:
        try:
            slot_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RsmemError(f"--slot-save-path {slot_dir}: {exc.strerror}") from exc
    cache_dir = options.cache_dir
    if cache_dir is not None:
        try:
            cache_dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RsmemError(f"--cache-dir {cache_dir}: {exc.strerror}") from exc
    try:
        engine = _engine(llm, options, cache_dir)
    except OSError as exc:  # the cache dir's model folder cannot be made or read
        if cache_dir is None:
            raise
        raise RsmemError(f"--cache-dir {cache_dir}: {exc.strerror or exc}") from exc
    settings = ServerSettings(
        model_name=options.alias or path.stem,
        model_aliases=frozenset({path.name, path.stem, str(path)}),
        api_key=options.api_key,
        slot_save_path=slot_dir,
        max_body_bytes=options.max_body_bytes,
        max_prompt_tokens=options.max_prompt_tokens,
        max_tokens_limit=options.max_tokens_limit,
        chat_template=template,
        cors_origins=tuple(options.cors_origins),
    )
    runner = EngineRunner(engine, max_queue=options.max_queue)
    app = create_app(runner, settings)
    return ServerApp(app, app.state.rsmem)


def bind_socket(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` (not yet listening); RsmemError with one clear line if it cannot be."""
    where = f"{host}:{port}"
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError) as exc:
        raise RsmemError(f"cannot listen on {where}: unknown host {host!r}") from exc
    except OverflowError as exc:
        raise RsmemError(f"cannot listen on {where}: a port is 0 to 65535") from exc
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise RsmemError(f"cannot listen on {where}: {exc.strerror or exc}") from exc
    sock.set_inheritable(True)
    return sock


@dataclass(slots=True)
class _Shutdown:
    """What a graceful shutdown did, for its one line."""

    in_flight: int = 0
    cancelled: int = 0
    forced: bool = False
    seconds: float = 0.0


class _GracefulServer(uvicorn.Server):
    """uvicorn's server with rsmem's shutdown: stop accepting, drain for ``timeout`` seconds, then
    cancel; signals are handled by :func:`run_server` (and never re-raised)."""

    def __init__(
        self, config: uvicorn.Config, state: AppState, timeout: float, stop: threading.Event | None
    ) -> None:
        super().__init__(config)
        self.state, self.timeout, self.stop = state, timeout, stop
        self.report = _Shutdown()

    async def on_tick(self, counter: int) -> bool:
        if self.stop is not None and self.stop.is_set():
            self.should_exit = True
        return await super().on_tick(counter)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield  # run_server installs its own handlers around the whole run

    def on_signal(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:
            self.force_exit = True
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.state.accepting = False
        for server in getattr(self, "servers", []):
            server.close()  # no new connections; the open ones may finish their requests
        runner, t0 = self.state.runner, time.monotonic()
        self.report.in_flight = runner.in_flight
        while runner.in_flight and not self.force_exit and time.monotonic() - t0 < self.timeout:
            await asyncio.sleep(0.02)
        if runner.in_flight and runner.alive:
            self.report.cancelled = await runner.abort_all()
            deadline = time.monotonic() + 1.0  # let the handlers send what their clients get
            while runner.in_flight and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        self.report.forced = self.force_exit
        self.report.seconds = time.monotonic() - t0
        # Everything is aborted by now, so uvicorn's own wait is short: let it close the connections and
        # run the lifespan shutdown even after a second signal (skipping it leaves a cancelled task
        # that logs a traceback).
        self.force_exit = False
        await super().shutdown(sockets)


def run_server(
    llm: LLM,
    options: ServeOptions,
    *,
    sock: socket.socket | None = None,
    out: TextIO | None = None,
    stop: threading.Event | None = None,
) -> int:
    """Serve until SIGINT/SIGTERM; 0 after a graceful shutdown. Raises RsmemError for a bad option or
    an address that cannot be bound, before writing anything.

    ``sock``: a socket from :func:`bind_socket` (a caller may bind before loading the model, so a busy
    port is reported at once); by default ``options.host:options.port`` is bound here. It is closed
    when the server stops. ``stop``: setting it shuts the server down as a first signal would (for a
    caller that runs the server in a thread, where there are no signals)."""
    out = out or sys.stderr
    options.check()
    sock = sock or bind_socket(options.host, options.port)
    try:
        served = build_app(llm, options)
        host, port = sock.getsockname()[:2]
        note = " (chat template from the model)" if served.state.settings.chat_template.source else ""
        kv = llm.context.max_seq_tokens  # a hybrid's KV positions per slot (the prompt limit)
        note += f", a context of {kv} tokens each (--ctx-size)" if kv is not None else ""
        out.write(
            f"rsmem serve: {served.state.settings.model_name} on http://{_url_host(host)}:{port} "
            f"with {llm.context.n_seq_max} slots{note}\n"
        )
        out.flush()
        config = uvicorn.Config(
            served.app, log_level=options.log_level, lifespan="on", timeout_graceful_shutdown=2
        )
        server = _GracefulServer(config, served.state, options.shutdown_timeout, stop)
        with _signals(server):
            server.run(sockets=[sock])
            served.runner.stop()
            out.write(_summary(server.report) + "\n")
            out.flush()
    finally:
        sock.close()
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _summary(r: _Shutdown) -> str:
    if not r.in_flight:
        return "rsmem serve: stopped (no requests in flight)"
    done = r.in_flight - r.cancelled
    how = "at a second signal" if r.forced else f"after {r.seconds:.1f} s"
    return f"rsmem serve: stopped: {done} request(s) in flight finished, {r.cancelled} cancelled {how}"


@contextlib.contextmanager
def _signals(server: _GracefulServer) -> Iterator[None]:
    """SIGINT/SIGTERM ask ``server`` to shut down (a second one: at once) for the whole run, cleanup
    included, so no signal ends in a KeyboardInterrupt traceback. Only the main thread has signals."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, server.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _engine(llm: LLM, options: ServeOptions, cache_dir: Path | None) -> Engine:
    return Engine(
        llm.context,
        llm.tokenizer,
        prompt_cache=not options.no_prompt_cache,
        max_prompt_tokens=options.max_prompt_tokens,
        max_tokens_limit=options.max_tokens_limit,
        cache_bytes=0 if options.no_prompt_cache else options.cache_ram << 20,
        checkpoint_interval=options.checkpoint_interval,
        checkpoint_codec=options.checkpoint_codec,
        cache_dir=None if options.no_prompt_cache else cache_dir,
        cache_disk_bytes=options.cache_disk << 20,
        prefill_cap=options.prefill_cap,
    )
