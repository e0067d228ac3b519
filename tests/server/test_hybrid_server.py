"""The server on a hybrid model (LFM2 from llama.cpp's fixture GGUF): completions from token ids and text,
concurrent requests, the prefix cache, slot files, /metrics and /slots, a 400 naming the max context for a
prompt over a slot's KV cells, and ``run_server``'s start line."""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
import uvicorn

from rsmem.engine import LLM, SamplingParams
from rsmem.server import ServeOptions, bind_socket, build_app, run_server

pytestmark = pytest.mark.subprocess

PATH = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "lfm2" / "model-f32.gguf"
N_VOCAB = 300


def seq(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % N_VOCAB for k in range(n)]


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(PATH, n_seq_max=2, n_batch=128, n_ctx=512)  # 256 KV positions a slot


@contextmanager
def serving(llm: LLM, **options) -> Iterator[str]:
    served = build_app(llm, ServeOptions(alias="m", model_path=PATH, **options))
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
        llm.context.memory.clear()


@pytest.fixture(scope="module")
def url(llm, tmp_path_factory) -> Iterator[str]:
    with serving(llm, slot_save_path=tmp_path_factory.mktemp("slots"), checkpoint_interval=16) as base:
        yield base


def complete(url: str, prompt, **body) -> httpx.Response:
    body = {"model": "m", "prompt": prompt, "max_tokens": 5, "temperature": 0} | body
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_token_id_prompts_run_concurrently_and_match_the_engine(url, llm):
    prompts = [seq(1, 20), seq(2, 37), seq(3, 9)]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda p: complete(url, p), prompts))
    alone = LLM(PATH, n_seq_max=1, n_ctx=512)
    for prompt, r in zip(prompts, replies, strict=True):
        assert r.status_code == 200, r.text
        want = alone.generate(prompt, SamplingParams.greedy(max_tokens=5))[0].outputs[0].text
        assert r.json()["choices"][0]["text"] == want
        assert r.json()["usage"]["prompt_tokens"] == len(prompt)


def test_a_repeated_prompt_comes_from_the_prefix_cache(url):
    system = seq(5, 40)
    first = complete(url, system + seq(80, 4))
    for other in (seq(90, 30), seq(91, 30)):  # take both slots away from the first prompt
        assert complete(url, other).status_code == 200
    again = complete(url, system + seq(80, 4))
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 43  # all but one token
    assert again.json()["choices"][0]["text"] == first.json()["choices"][0]["text"]
    metrics = httpx.get(f"{url}/metrics").text
    assert "rsmem_memory_cells_total" in metrics
    assert httpx.get(f"{url}/slots").status_code == 200


def test_a_prompt_over_a_slots_context_is_a_400_naming_it(url):
    r = complete(url, seq(1, 257))
    assert r.status_code == 400
    assert "max context of 256" in r.json()["error"]["message"]
    assert complete(url, seq(1, 256), max_tokens=3).status_code == 200  # fits: ends at the context


def test_chat_and_slot_files(url):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "temperature": 0}
    chat = httpx.post(f"{url}/v1/chat/completions", json=body | {"id_slot": 0}, timeout=60)
    assert chat.status_code == 200, chat.text
    saved = httpx.post(f"{url}/slots/0?action=save", json={"filename": "s.bin"}, timeout=60)
    assert saved.status_code == 200, saved.text
    assert saved.json()["n_saved"] > 0
    restored = httpx.post(f"{url}/slots/1?action=restore", json={"filename": "s.bin"}, timeout=60)
    assert restored.status_code == 200, restored.text
    assert restored.json()["n_restored"] == saved.json()["n_saved"]


def test_run_server_names_the_context_per_slot(llm):
    out, stop = io.StringIO(), threading.Event()
    sock = bind_socket("127.0.0.1", 0)
    options = ServeOptions(alias="m", model_path=PATH, port=sock.getsockname()[1])
    thread = threading.Thread(
        target=run_server, args=(llm, options), kwargs={"sock": sock, "out": out, "stop": stop}
    )
    thread.start()
    deadline = time.monotonic() + 30
    while "slots" not in out.getvalue() and time.monotonic() < deadline:
        time.sleep(0.05)
    stop.set()
    thread.join(timeout=30)
    assert "with 2 slots" in out.getvalue() and "a context of 256 tokens each" in out.getvalue()
