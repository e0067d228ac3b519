"""``/metrics`` counts a request whose client left before its answer was complete as status 499: a
streaming one (its 200 was already sent) as well as a JSON one; a stream read to its end stays a 200."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import httpx
import pytest

from helpers.server import MODEL, LiveServer, start_server

pytestmark = pytest.mark.subprocess

PATH = "/v1/completions"


@pytest.fixture(scope="module")
def server(shared_llm) -> Iterator[LiveServer]:
    with start_server(shared_llm, max_tokens_limit=None) as live:
        yield live


def request_counts(live: LiveServer) -> dict[int, int]:
    """``rsmem_requests_total`` of the completions route, by status code."""
    counts = {}
    for line in httpx.get(f"{live.url}/metrics").text.splitlines():
        if line.startswith(f'rsmem_requests_total{{path="{PATH}",'):
            code = int(line.split('code="')[1].split('"')[0])
            counts[code] = int(float(line.split()[-1]))
    return counts


def endless(live: LiveServer, stream: bool) -> dict:
    """Greedy with EOS banned and no useful limit: only a cancellation ends it."""
    eos = live.engine.tokenizer.eos_token_id
    return {
        "model": MODEL,
        "prompt": "ROMEO:",
        "max_tokens": 1_000_000,
        "temperature": 0,
        "logit_bias": {str(eos): -100},
        "stream": stream,
    }


def open_request(live: LiveServer, body: dict) -> socket.socket:
    payload = json.dumps(body).encode()
    host, port = live.url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    head = (
        f"POST {PATH} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def wait_for(predicate, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_counts_as_499(server: LiveServer, stream: bool) -> None:
    before = request_counts(server)
    sock = open_request(server, endless(server, stream))
    if stream:
        first = sock.recv(4096)  # the status line and the first events: the 200 is on its way
        assert first.startswith(b"HTTP/1.1 200")
    wait_for(lambda: server.snapshot()["rsmem_requests_running"] == 1, "the request to run")
    sock.close()
    wait_for(lambda: request_counts(server).get(499, 0) == before.get(499, 0) + 1, "a 499 to be counted")
    server.wait_idle()
    assert request_counts(server).get(200, 0) == before.get(200, 0)  # not also a 200


def test_a_stream_read_to_its_end_counts_as_200(server: LiveServer) -> None:
    before = request_counts(server)
    body = {"model": MODEL, "prompt": "ROMEO:", "max_tokens": 4, "stream": True}
    with httpx.stream("POST", f"{server.url}{PATH}", json=body) as r:
        assert r.status_code == 200
        assert "[DONE]" in "".join(r.iter_text())
    wait_for(lambda: request_counts(server).get(200, 0) == before.get(200, 0) + 1, "a 200 to be counted")
    assert request_counts(server).get(499, 0) == before.get(499, 0)
