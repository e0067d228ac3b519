"""The server on Qwen3.5 (the fixture GGUF, tests/fixtures/llamacpp/qwen35) unchanged: concurrent completions
from token ids match ``LLM.generate`` alone, a repeated prompt comes from the prefix cache (delta-net rows
plus the KV prefix) with the same text, and a slot saved to a file restores into the other slot."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
import uvicorn

from rsmem.engine import LLM, SamplingParams
from rsmem.server import ServeOptions, bind_socket, build_app

pytestmark = pytest.mark.subprocess

PATH = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "qwen35" / "model-f32.gguf"


def seq(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % 300 for k in range(n)]


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    llm = LLM(PATH, n_seq_max=2, n_batch=128, n_ctx=512)
    options = ServeOptions(
        alias="m", model_path=PATH, slot_save_path=tmp_path_factory.mktemp("slots"), checkpoint_interval=16
    )
    served = build_app(llm, options)
    sock = bind_socket("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(served.app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        served.runner.stop()
        sock.close()


def complete(url: str, prompt: list[int], **body: object) -> httpx.Response:
    payload = {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0} | body
    return httpx.post(f"{url}/v1/completions", json=payload, timeout=60)


def test_completions_match_the_engine_alone_and_the_prefix_cache(url: str) -> None:
    prompts = [seq(1, 20), seq(2, 37), seq(3, 9)]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda p: complete(url, p), prompts))
    alone = LLM(PATH, n_seq_max=1, n_ctx=512)
    for prompt, r in zip(prompts, replies, strict=True):
        assert r.status_code == 200, r.text
        want = alone.generate(prompt, SamplingParams.greedy(max_tokens=5))[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == want
    system = seq(5, 40)
    first = complete(url, system + seq(80, 4))
    for other in (seq(90, 30), seq(91, 30)):  # take both slots away from the first prompt
        assert complete(url, other).status_code == 200
    again = complete(url, system + seq(80, 4))
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]


def test_slot_files(url: str) -> None:
    assert complete(url, seq(7, 25), id_slot=0).status_code == 200
    saved = httpx.post(f"{url}/slots/0?action=save", json={"filename": "s.bin"}, timeout=60)
    assert saved.status_code == 200, saved.text
    restored = httpx.post(f"{url}/slots/1?action=restore", json={"filename": "s.bin"}, timeout=60)
    assert restored.status_code == 200, restored.text
    assert restored.json()["n_restored"] == saved.json()["n_saved"] > 0
