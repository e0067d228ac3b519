"""A live server on a free loopback port (``start_server``), the model the server tests serve, and the
``LiveServer`` handle the tests drive with the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from rsmem.engine import LLM, Engine, default_model_path
from rsmem.server import EngineRunner, ServeOptions, ServerSettings, build_app

MODEL = "test-model"


def model_path() -> Path:
    return Path(os.environ.get("RSMEM_TEST_MODEL", default_model_path()))


@dataclass
class LiveServer:
    url: str
    engine: Engine
    runner: EngineRunner
    settings: ServerSettings

    @property
    def base_url(self) -> str:
        return f"{self.url}/v1"

    def snapshot(self) -> dict[str, float]:
        """The engine's state as /metrics reports it (gauges and counters without labels)."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics", headers=self.auth()).text.splitlines():
            if line and not line.startswith("#") and "{" not in line:
                name, value = line.split()
                out[name] = float(value)
        return out

    def auth(self) -> dict[str, str]:
        key = self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def wait_idle(self, timeout: float = 20) -> None:
        """Until no request runs or waits and no cell is held by one."""
        deadline = time.monotonic() + timeout
        while True:
            m = self.snapshot()
            if not (m["rsmem_requests_running"] or m["rsmem_queue_length"] or m["rsmem_memory_cells_active"]):
                return
            assert time.monotonic() < deadline, f"requests did not finish: {m}"
            time.sleep(0.05)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def start_server(llm: LLM, **options) -> Iterator[LiveServer]:
    """``build_app`` (what ``run_server`` serves) under uvicorn in a thread; ``options`` are ServeOptions."""
    options.setdefault("max_queue", 16)
    options.setdefault("alias", MODEL)
    served = build_app(llm, ServeOptions(**options))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(served.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        url = f"http://127.0.0.1:{port}"
        yield LiveServer(url, served.runner.engine, served.runner, served.state.settings)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        served.runner.stop()
        llm.context.memory.clear()
