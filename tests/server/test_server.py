"""The OpenAI-compatible server, through the official ``openai`` client and raw HTTP."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest

from helpers.server import MODEL, LiveServer, start_server

pytestmark = pytest.mark.subprocess

PROMPT = "To be, or not to be"


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0)


def greedy_text(client: openai.OpenAI, prompt: str, max_tokens: int = 12, **kw) -> str:
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, **kw)
    return r.choices[0].text


def metric(live: LiveServer, name: str) -> float:
    text = httpx.get(f"{live.url}/metrics").text
    for line in text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def wait_idle(live: LiveServer, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while metric(live, "rsmem_requests_running") or metric(live, "rsmem_memory_cells_active"):
        assert time.monotonic() < deadline, "requests did not finish"
        time.sleep(0.05)


def test_completion(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    assert r.object == "text_completion"
    assert len(r.choices) == 1 and r.choices[0].text
    assert r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Speak as a player."},
            {"role": "user", "content": "Who art thou?"},
        ],
        max_tokens=10,
        temperature=0,
    )
    assert r.object == "chat.completion"
    assert r.choices[0].message.role == "assistant"
    assert isinstance(r.choices[0].message.content, str)


def test_streaming_completion_equals_non_streaming(client):
    want = greedy_text(client, PROMPT, 16)
    chunks = list(
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=0, stream=True)
    )
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason is not None


def test_streaming_chat_equals_non_streaming(client):
    msgs = [{"role": "user", "content": "Speak, friend."}]
    want = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=12, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.choices[0].message.content


def test_n_completions(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=1.0, n=3, seed=5)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]


def test_stop_strings_cut_the_text(client):
    full = greedy_text(client, PROMPT, 20)
    stop = full[5:8]
    assert stop.strip(), full
    cut = greedy_text(client, PROMPT, 20, stop=[stop])
    assert cut == full[: full.index(stop)]


def test_seeds_reproduce(client):
    def sampled(seed: int) -> str:
        r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=16, temperature=1.0, seed=seed)
        return r.choices[0].text

    assert sampled(11) == sampled(11)
    assert len({sampled(11), sampled(12), sampled(13)}) > 1


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == r.usage.completion_tokens
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(t) <= 2 for t in lp.top_logprobs)  # tokens decoding alike share a key
    c = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
    )
    assert len(c.choices[0].logprobs.content) == c.usage.completion_tokens


def test_models_and_health(live):
    assert httpx.get(f"{live.base_url}/models").json()["data"][0]["id"] == "test-model"
    h = httpx.get(f"{live.url}/health").json()
    assert h["status"] == "ok" and h["slots_idle"] + h["slots_processing"] == 4


def test_slot_save_restore_continues_like_an_uninterrupted_run(client, live):
    def greedy_ids(prompt: list[int], slot: int) -> list[int]:
        r = client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=10,
            temperature=0,
            extra_body={"id_slot": slot, "return_token_ids": True},
        )
        return r.choices[0].model_extra["token_ids"]

    prompt = live.engine.tokenizer.encode(PROMPT)
    first = greedy_ids(prompt, 0)
    saved = httpx.post(f"{live.url}/slots/0?action=save", json={"filename": "parked.bin"}).json()
    assert saved["n_saved"] == len(prompt) + len(first) - 1  # the last sampled token is not in the state yet
    assert (live.settings.slot_save_path / "parked.bin").is_file()
    assert httpx.post(f"{live.url}/slots/0?action=erase").json()["n_erased"] == saved["n_saved"]
    restored = httpx.post(f"{live.url}/slots/1?action=restore", json={"filename": "parked.bin"}).json()
    assert restored["n_restored"] == saved["n_saved"]

    follow = prompt + first + live.engine.tokenizer.encode(" and")
    cached_before = metric(live, "rsmem_prompt_tokens_cached_total")
    processed_before = metric(live, "rsmem_prompt_tokens_total")
    resumed = greedy_ids(follow, 1)
    assert metric(live, "rsmem_prompt_tokens_cached_total") - cached_before == saved["n_saved"]
    assert metric(live, "rsmem_prompt_tokens_total") - processed_before == len(follow) - saved["n_saved"]
    httpx.post(f"{live.url}/slots/2?action=erase")
    assert greedy_ids(follow, 2) == resumed  # the same continuation as processing everything


@pytest.mark.parametrize("name", ["../x", "a/b", "", "..", ".hidden"])
def test_slot_filenames_are_checked(live, name):
    r = httpx.post(f"{live.url}/slots/0?action=save", json={"filename": name})
    assert r.status_code == 400
    assert "filename" in r.json()["error"]["message"]


def test_bad_requests_get_400_with_a_clear_message(live, client):
    r = httpx.post(
        f"{live.base_url}/completions", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt=PROMPT, temperature=3.5)
    limit = r"max_tokens 100 exceeds the limit of 64 \(--max-tokens-limit\)"
    with pytest.raises(openai.BadRequestError, match=limit):
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=100)
    with pytest.raises(openai.BadRequestError, match=r"more than the limit of 200 \(--max-prompt-tokens\)"):
        client.completions.create(model=MODEL, prompt=" word" * 300, max_tokens=4)
    with pytest.raises(openai.APIStatusError, match="request body exceeds the limit of 20000 bytes") as info:
        client.completions.create(model=MODEL, prompt="x" * 30_000, max_tokens=4)
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL, prompt=PROMPT, logit_bias={"5": 500})
    with pytest.raises(openai.BadRequestError, match="n"):
        client.completions.create(model=MODEL, prompt=PROMPT, n=0)
    r = httpx.post(f"{live.url}/slots/0?action=explode")
    assert r.status_code == 400 and "unknown action" in r.json()["error"]["message"]


def test_client_disconnect_mid_stream_frees_its_sequence(live):
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0.8, "stream": True}
    with httpx.stream("POST", f"{live.base_url}/completions", json=body) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
    wait_idle(live)
    assert metric(live, "rsmem_memory_cells_active") == 0


def test_metrics_text(live, client):
    greedy_text(client, PROMPT, 2)
    text = httpx.get(f"{live.url}/metrics").text
    for name in (
        "rsmem_requests_total",
        "rsmem_prompt_tokens_total",
        "rsmem_generation_tokens_total",
        "rsmem_tokens_per_second",
        "rsmem_queue_length",
        "rsmem_memory_cells_used",
    ):
        assert name in text
    assert metric(live, "rsmem_generation_tokens_total") > 0


def test_api_key_is_required_except_for_health(shared_llm):
    with start_server(shared_llm, api_key="sekrit") as server:
        bad = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        assert httpx.get(f"{server.url}/metrics").status_code == 401
        assert httpx.get(f"{server.url}/health").status_code == 200
        good = openai.OpenAI(base_url=server.base_url, api_key="sekrit", max_retries=0)
        assert good.models.list().data[0].id == "test-model"


def test_full_queue_gets_503_with_retry_after(shared_llm):
    with start_server(shared_llm, max_queue=1) as server:
        statuses: list[httpx.Response] = []
        body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 60, "temperature": 0}

        def post() -> None:
            statuses.append(httpx.post(f"{server.base_url}/completions", json=body, timeout=60))

        threads = [threading.Thread(target=post) for _ in range(8)]  # 4 slots + 1 queued: the rest wait
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        codes = sorted(r.status_code for r in statuses)
        assert codes.count(200) >= 5 and 503 in codes
        busy = next(r for r in statuses if r.status_code == 503)
        assert busy.headers["retry-after"] == "1"
        assert "busy" in busy.json()["error"]["message"]
