"""A schema-driven fuzz of the HTTP API: schemathesis generates requests from FastAPI's own OpenAPI
document (valid ones, and invalid ones) and sends them to a live loopback server.

No answer may be a 5xx, every error must be OpenAI's error object, and the server must still serve
afterwards. Bounded: a fixed number of examples per operation and mode, a derandomised run, and a
wall-clock budget (the whole test stays well under a minute on two cores).
"""

from __future__ import annotations

import time

import httpx
import pytest

from helpers.server import MODEL, LiveServer, start_server

pytestmark = [pytest.mark.subprocess, pytest.mark.fuzz]

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, Phase, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

EXAMPLES = 60  # per operation and generation mode
BUDGET_S = 45.0


def fuzz_operation(live: LiveServer, operation, mode: GenerationMode, deadline: float) -> int:  # type: ignore[no-untyped-def]
    calls = 0

    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=operation.as_strategy(generation_mode=mode))
    def check(case) -> None:  # type: ignore[no-untyped-def]
        nonlocal calls
        if time.monotonic() > deadline:
            return
        response = case.call(base_url=live.url, timeout=30)
        calls += 1
        where = f"{case.method} {case.formatted_path} {case.body!r:.300}"
        assert response.status_code < 500, f"{where} -> {response.status_code} {response.text[:300]}"
        if response.status_code >= 400:
            body = response.json()
            assert set(body) == {"error"} and body["error"]["message"], f"{where} -> {body}"

    try:
        check()
    except Unsatisfiable:  # no invalid request exists for an operation without parameters or body
        assert mode is GenerationMode.NEGATIVE
    return calls


def test_schema_fuzz_finds_no_server_error(shared_llm, tmp_path):
    with start_server(
        shared_llm,
        slot_save_path=tmp_path,
        max_tokens_limit=8,
        max_prompt_tokens=64,
        max_body_bytes=8192,
        max_queue=8,
    ) as live:
        schema = schemathesis.openapi.from_url(f"{live.url}/openapi.json")
        deadline = time.monotonic() + BUDGET_S
        calls = 0
        labels = []
        for result in schema.get_all_operations():
            operation = result.ok()
            labels.append(operation.label)
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                calls += fuzz_operation(live, operation, mode, deadline)
        assert {"POST /v1/completions", "POST /v1/chat/completions", "POST /slots/{slot_id}"} <= set(labels)
        print(f"fuzz: {calls} requests")
        assert calls >= 100, f"only {calls} requests were sent"

        live.wait_idle()
        assert httpx.get(f"{live.url}/health").json()["status"] == "ok"
        r = httpx.post(
            f"{live.base_url}/completions", json={"model": MODEL, "prompt": "ROMEO:", "max_tokens": 4}
        )
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
