"""A live server on a free loopback port, driven by the official ``openai`` client."""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
import uvicorn

from rsmem.engine import LLM, Engine, default_model_path
from rsmem.server import EngineRunner, ServerSettings, create_app


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def shared_llm() -> LLM:
    return LLM(model_path(), n_seq_max=4, n_batch=256)


@contextmanager
def start_server(llm: LLM, *, max_queue: int = 16, **settings) -> Iterator[LiveServer]:
    engine = Engine(llm.context, llm.tokenizer, prompt_cache=True)
    runner = EngineRunner(engine, max_queue=max_queue)
    cfg = ServerSettings(model_name="test-model", **settings)
    app = create_app(runner, cfg)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("server did not start")
        time.sleep(0.02)
    try:
        yield LiveServer(f"http://127.0.0.1:{port}", engine, runner, cfg)
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        runner.stop()
        llm.context.memory.clear()


@pytest.fixture(scope="module")
def live(shared_llm: LLM, tmp_path_factory) -> Iterator[LiveServer]:
    slot_dir = tmp_path_factory.mktemp("slots")
    with start_server(
        shared_llm, slot_save_path=slot_dir, max_prompt_tokens=200, max_tokens_limit=64, max_body_bytes=20_000
    ) as server:
        yield server
