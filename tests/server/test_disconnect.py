"""A client that goes away cancels its request at once: non-streaming or streaming, decoding or queued."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.server import MODEL, LiveServer, start_server

pytestmark = pytest.mark.subprocess

NEVER_ENDING = 1_000_000  # max_tokens no test waits for: only a cancellation frees the slot


@pytest.fixture(scope="module")
def unlimited(shared_llm) -> Iterator[LiveServer]:
    with start_server(shared_llm, max_tokens_limit=None, max_queue=4) as server:
        yield server


def endless_body(live: LiveServer, *, stream: bool = False) -> dict:
    """Greedy with EOS banned: generates until max_tokens (minutes) unless cancelled."""
    eos = live.engine.tokenizer.eos_token_id
    return {
        "model": MODEL,
        "prompt": "ROMEO:",
        "max_tokens": NEVER_ENDING,
        "temperature": 0,
        "logit_bias": {str(eos): -100},
        "stream": stream,
    }


class RawClient:
    """One HTTP request on a plain socket, so the test decides exactly when the client goes away."""

    def __init__(self, live: LiveServer, body: dict, path: str = "/v1/completions") -> None:
        payload = json.dumps(body).encode()
        host, port = live.url.removeprefix("http://").split(":")
        self.sock = socket.create_connection((host, int(port)))
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n"
        )
        self.sock.sendall(head.encode() + payload)

    def close(self) -> None:
        self.sock.close()


def metrics(live: LiveServer) -> dict[str, float]:
    return live.snapshot()


def wait_for(predicate, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not predicate():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
    return time.monotonic() - t0


def generated(live: LiveServer) -> float:
    return metrics(live)["rsmem_generation_tokens_total"]


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_decoding_frees_the_slot_at_once(unlimited, stream):
    live = unlimited
    client = RawClient(live, endless_body(live, stream=stream))
    wait_for(lambda: metrics(live)["rsmem_requests_running"] == 1, 10, "the request to start")
    start = generated(live)
    wait_for(lambda: generated(live) > start + 20, 10, "tokens to be generated")
    client.close()
    took = wait_for(lambda: metrics(live)["rsmem_requests_running"] == 0, 5, "the request to be cancelled")
    assert took < 3
    live.wait_idle()
    slots = httpx.get(f"{live.url}/slots").json()
    assert not any(s["busy"] for s in slots)


@pytest.mark.parametrize("stream", [False, True])
def test_disconnect_while_queued_removes_the_request(unlimited, stream):
    live = unlimited
    busy = [RawClient(live, endless_body(live, stream=True)) for _ in range(4)]  # every slot
    try:
        wait_for(lambda: metrics(live)["rsmem_requests_running"] == 4, 10, "the slots to fill")
        queued = RawClient(live, endless_body(live, stream=stream))
        wait_for(lambda: metrics(live)["rsmem_queue_length"] == 1, 10, "the request to queue")
        queued.close()
        wait_for(lambda: metrics(live)["rsmem_queue_length"] == 0, 3, "the queued request to be removed")
        assert metrics(live)["rsmem_requests_running"] == 4  # the others go on
    finally:
        for c in busy:
            c.close()
    live.wait_idle()
    # a new request is served normally
    r = httpx.post(f"{live.base_url}/completions", json={"model": MODEL, "prompt": "KING:", "max_tokens": 3})
    assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] == "length"
