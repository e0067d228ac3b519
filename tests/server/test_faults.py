"""Fault injection through the HTTP server, each fault next to good requests running concurrently.

Faults: a model that raises on one request's sequences, sampling parameters that overflow (refused at
add time) and a NaN state that reaches sampling, a slot restored from a NaN ``.ggsq``, clients that
disconnect while queued, prefilling and decoding, and a full queue. The good requests (each pinned to
its own slot) must produce exactly the greedy text they produce alone; after the suite every slot is
free, no cell is active, ``/health`` is ok (or degraded, with a reason, after a model failure) and a
new request is served. The tests run in file order; the last one checks the aftermath.
"""

from __future__ import annotations

import json
import math
import socket
import struct
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.server import MODEL, LiveServer, model_path, start_server
from rsmem.batch.batch import UBatch
from rsmem.engine import LLM, load_text_model
from rsmem.models.faulty import FaultyModel
from rsmem.models.protocol import StateAccess

pytestmark = pytest.mark.subprocess

GOOD = [("ROMEO:", 0), ("JULIET:\nO Romeo,", 1), ("KING HENRY:", 2)]  # (prompt, pinned slot)
BAD_SLOT = 3
MAX_TOKENS = 40


class SlowFaultyModel(FaultyModel):
    """A FaultyModel that also sleeps ``delay`` s in each micro-batch holding one of ``slow``'s
    sequences, so a test can catch a request in its prefill."""

    def __init__(self, model) -> None:  # type: ignore[no-untyped-def]
        super().__init__(model)
        self.delay = 0.0
        self.slow: set[int] = set()

    def forward(self, ubatch: UBatch, states: StateAccess):  # type: ignore[no-untyped-def]
        if self.delay and self.slow & {s for ids in ubatch.seq_ids for s in ids}:
            time.sleep(self.delay)
        return super().forward(ubatch, states)


@pytest.fixture(scope="module")
def faulty() -> SlowFaultyModel:
    model, _ = load_text_model(model_path())
    return SlowFaultyModel(model)


@pytest.fixture(scope="module")
def faulty_llm(faulty: SlowFaultyModel) -> LLM:
    _, tok = load_text_model(model_path())
    return LLM(faulty, tokenizer=tok, n_seq_max=4, n_batch=256)


@pytest.fixture(scope="module")
def server(faulty_llm: LLM, tmp_path_factory) -> Iterator[LiveServer]:
    folder = tmp_path_factory.mktemp("fault-slots")
    with start_server(faulty_llm, slot_save_path=folder, max_tokens_limit=None, max_queue=8) as live:
        yield live


def body(prompt: str, slot: int | None, max_tokens: int = MAX_TOKENS, **extra) -> dict:
    out = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0} | extra
    return out | ({"id_slot": slot} if slot is not None else {})


def complete(live: LiveServer, payload: dict) -> httpx.Response:
    return httpx.post(f"{live.base_url}/completions", json=payload, timeout=120)


@pytest.fixture(scope="module")
def alone(server: LiveServer) -> dict[str, str]:
    """Each good prompt's greedy text when it runs by itself."""
    texts = {}
    for prompt, slot in GOOD:
        r = complete(server, body(prompt, slot))
        assert r.status_code == 200, r.text
        texts[prompt] = r.json()["choices"][0]["text"]
    return texts


class Goods:
    """The good requests, running concurrently in threads while a fault happens."""

    def __init__(self, live: LiveServer, max_tokens: int = MAX_TOKENS) -> None:
        self.results: dict[str, httpx.Response] = {}
        self.threads = [
            threading.Thread(target=self._run, args=(live, p, s, max_tokens), daemon=True) for p, s in GOOD
        ]
        for t in self.threads:
            t.start()

    def _run(self, live: LiveServer, prompt: str, slot: int, max_tokens: int) -> None:
        self.results[prompt] = complete(live, body(prompt, slot, max_tokens))

    def assert_exact(self, alone: dict[str, str]) -> None:
        for t in self.threads:
            t.join(timeout=120)
        for prompt, _ in GOOD:
            r = self.results[prompt]
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["text"] == alone[prompt], prompt


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def running(live: LiveServer) -> float:
    return live.snapshot()["rsmem_requests_running"]


class RawClient:
    """A request on a plain socket, so the test decides when the client leaves."""

    def __init__(self, live: LiveServer, payload: dict) -> None:
        data = json.dumps(payload).encode()
        host, port = live.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        self.sock.sendall(f"{head}Content-Length: {len(data)}\r\n\r\n".encode() + data)

    def close(self) -> None:
        self.sock.close()


def endless(live: LiveServer, prompt: str, slot: int | None) -> dict:
    eos = live.engine.tokenizer.eos_token_id
    return body(prompt, slot, 1_000_000, logit_bias={str(eos): -100})


# --------------------------------------------------------------- faults


def test_model_fault_fails_only_its_request(server, faulty, alone):
    faulty.raise_when(lambda seqs: BAD_SLOT in seqs)
    try:
        goods = Goods(server)
        bad = complete(server, body("HAMLET:", BAD_SLOT))
    finally:
        faulty.raise_when(None)
    assert bad.status_code == 500, bad.text
    err = bad.json()["error"]
    assert err["type"] == "server_error" and "InjectedFault" in err["message"]
    goods.assert_exact(alone)
    assert faulty.faults_raised >= 1
    health = httpx.get(f"{server.url}/health").json()
    assert health["status"] in ("ok", "degraded")
    assert health["status"] == "ok" or "InjectedFault" in health["reason"]


def test_model_fault_in_a_stream_ends_with_an_error_event(server, faulty):
    faulty.raise_when(lambda seqs: BAD_SLOT in seqs)
    try:
        payload = body("HAMLET:", BAD_SLOT, stream=True)
        with httpx.stream("POST", f"{server.base_url}/completions", json=payload) as r:
            lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    finally:
        faulty.raise_when(None)
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["error"]["type"] == "server_error"


def test_overflowing_penalty_is_refused_at_add_time(server, alone):
    goods = Goods(server)
    r = complete(server, body("ROMEO: ROMEO: ROMEO:", BAD_SLOT, 3, repeat_penalty=1e-40))
    assert r.status_code == 400 and r.json()["error"]["param"] == "repeat_penalty"
    goods.assert_exact(alone)


def test_nan_state_fails_its_request_with_400(server, faulty, alone):
    goods = Goods(server)
    faulty.poison(BAD_SLOT)  # the next micro-batch holding it writes NaN into its state
    bad = complete(server, body("HAMLET:", BAD_SLOT))
    assert bad.status_code == 400, bad.text
    err = bad.json()["error"]
    assert err["type"] == "invalid_request_error" and "non-finite" in err["message"]
    goods.assert_exact(alone)


def test_one_failed_completion_of_n_fails_the_whole_request(server, faulty):
    for slot in range(4):
        httpx.post(f"{server.url}/slots/{slot}?action=erase")
    faulty.poison(0)  # the fork of a request pinned to slot 2 takes the lowest free uncached slot: 0
    r = complete(server, body("HAMLET:", 2, n=2))
    assert r.status_code == 400, r.text
    assert "non-finite" in r.json()["error"]["message"]
    ok = complete(server, body("HAMLET:", 0, 3))  # the poison was spent on the failed fork
    assert ok.status_code == 200, ok.text


def test_nan_slot_file_is_refused_at_restore(server, alone):
    assert complete(server, body("ROMEO:", BAD_SLOT, 4)).status_code == 200
    folder = server.settings.slot_save_path
    assert (
        httpx.post(f"{server.url}/slots/{BAD_SLOT}?action=save", json={"filename": "s.bin"}).status_code
        == 200
    )
    data = bytearray((folder / "s.bin").read_bytes())
    data[-8:] = struct.pack("<2f", math.nan, math.nan)
    (folder / "nan.bin").write_bytes(bytes(data))
    goods = Goods(server)
    r = httpx.post(f"{server.url}/slots/{BAD_SLOT}?action=restore", json={"filename": "nan.bin"})
    assert r.status_code == 400, r.text
    assert "non-finite" in r.json()["error"]["message"]
    goods.assert_exact(alone)


def test_disconnect_while_decoding(server, alone):
    goods = Goods(server, MAX_TOKENS)
    client = RawClient(server, endless(server, "HAMLET:", BAD_SLOT))
    wait_for(lambda: httpx.get(f"{server.url}/slots").json()[BAD_SLOT]["busy"], 10, "the request to start")
    client.close()
    wait_for(lambda: not httpx.get(f"{server.url}/slots").json()[BAD_SLOT]["busy"], 5, "the slot to free")
    goods.assert_exact(alone)


def test_disconnect_while_prefilling(server, faulty, alone):
    prompt = " ".join(["word"] * 2000)  # ~8 chunks of 256 tokens, each slowed to 0.1 s
    faulty.delay, faulty.slow = 0.1, {BAD_SLOT}
    try:
        before = server.snapshot()["rsmem_prompt_tokens_total"]
        goods = Goods(server)
        client = RawClient(server, body(prompt, BAD_SLOT, 5))
        wait_for(
            lambda: server.snapshot()["rsmem_prompt_tokens_total"] - before > 300, 20, "prefill to begin"
        )
        client.close()
        wait_for(lambda: not httpx.get(f"{server.url}/slots").json()[BAD_SLOT]["busy"], 5, "the slot to free")
    finally:
        faulty.delay, faulty.slow = 0.0, set()
    processed = server.snapshot()["rsmem_prompt_tokens_total"] - before
    n_prompt = len(server.engine.tokenizer.encode(prompt))  # 2001
    assert processed < n_prompt - 400, "the prompt was processed to the end"
    goods.assert_exact(alone)


def test_disconnect_while_queued(server, alone):
    hold = RawClient(server, endless(server, "HAMLET:", BAD_SLOT))
    try:
        goods = Goods(server, 200)  # long enough to keep every slot busy while the next one queues
        wait_for(lambda: running(server) == 4, 10, "every slot to be busy")
        queued = RawClient(server, body("OTHELLO:", None, 5))
        wait_for(lambda: server.snapshot()["rsmem_queue_length"] == 1, 10, "the request to queue")
        queued.close()
        wait_for(lambda: server.snapshot()["rsmem_queue_length"] == 0, 3, "the queued request to go")
    finally:
        hold.close()
    alone_200 = {p: complete(server, body(p, s, 200)).json()["choices"][0]["text"] for p, s in GOOD}
    goods.assert_exact(alone_200)


def test_full_queue_is_503_with_retry_after(faulty_llm, faulty, alone):
    with start_server(faulty_llm, max_queue=1, max_tokens_limit=None) as live:
        faulty.delay, faulty.slow = 0.02, {0, 1, 2, 3}  # keep the slots busy for a while
        try:
            goods = Goods(live)
            hold = RawClient(live, endless(live, "HAMLET:", BAD_SLOT))
            wait_for(lambda: running(live) == 4, 10, "every slot to be busy")
            queued = RawClient(live, body("OTHELLO:", None, 3))
            wait_for(lambda: live.snapshot()["rsmem_queue_length"] == 1, 10, "the request to queue")
            r = complete(live, body("MACBETH:", None, 3))
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["type"] == "server_error"
            hold.close()
            queued.close()
            goods.assert_exact(alone)
        finally:
            faulty.delay, faulty.slow = 0.0, set()
        live.wait_idle()


def test_after_the_suite_everything_is_free_and_served(server, alone):
    server.wait_idle()
    slots = httpx.get(f"{server.url}/slots").json()
    assert not any(s["busy"] for s in slots)
    m = server.snapshot()
    assert m["rsmem_memory_cells_active"] == 0 and m["rsmem_queue_length"] == 0
    health = httpx.get(f"{server.url}/health")
    assert health.status_code == 200
    assert health.json()["status"] == "ok" or health.json()["reason"]
    prompt, slot = GOOD[0]
    r = complete(server, body(prompt, slot))
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == alone[prompt]
