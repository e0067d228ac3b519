"""OpenAI's protocol, exactly: error objects everywhere, ids, model names, auth, CORS, streaming
log-probs and usage, cached tokens, several prompts in one request, and bounded metrics labels."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator

import httpx
import openai
import pytest

from helpers.server import MODEL, LiveServer, model_path, start_server

pytestmark = pytest.mark.subprocess

PROMPT = "To be, or not to be"


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0)


def assert_error_object(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}, body  # never {"detail": ...}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    return body["error"]


def sse_events(r: httpx.Response) -> list[dict | str]:
    events: list[dict | str] = []
    for line in r.iter_lines():
        if line.startswith("data: "):
            data = line[6:]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events


# ------------------------------------------------------------------ errors


def test_404_405_and_parse_errors_are_error_objects(live):
    assert_error_object(httpx.get(f"{live.url}/no/such/path"), 404)
    assert assert_error_object(httpx.get(f"{live.base_url}/completions"), 405)["code"] == "method_not_allowed"
    err = assert_error_object(
        httpx.post(
            f"{live.base_url}/completions", content=b"{oops", headers={"content-type": "application/json"}
        ),
        400,
    )
    assert "JSON" in err["message"]
    err = assert_error_object(
        httpx.post(f"{live.base_url}/completions", json={"prompt": PROMPT, "n": "x"}), 400
    )
    assert err["param"] == "n"
    assert_error_object(httpx.post(f"{live.base_url}/completions", json={"max_tokens": 3}), 400)
    assert_error_object(httpx.post(f"{live.url}/slots/abc?action=erase"), 400)
    assert_error_object(httpx.post(f"{live.url}/slots/0"), 400)  # no action


def test_body_above_the_limit_is_413_declared_or_streamed(live):
    big = json.dumps({"model": MODEL, "prompt": "x" * 30_000}).encode()
    err = assert_error_object(httpx.post(f"{live.base_url}/completions", content=big), 413)
    assert "--max-body-bytes" in err["message"]

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit is found while reading
        for k in range(0, len(big), 4096):
            yield big[k : k + 4096]

    assert_error_object(httpx.post(f"{live.base_url}/completions", content=chunks()), 413)


def test_engine_refusals_name_the_json_field(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"repeat_penalty": 1e-40}
        )
    assert info.value.body["param"] == "repeat_penalty"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=[999_999], max_tokens=3)
    assert info.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, extra_body={"id_slot": 9})
    assert info.value.body["param"] == "id_slot"
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, logit_bias={"999999": 1})
    assert info.value.body["param"] == "logit_bias"


# -------------------------------------------------------- ids and models


def test_ids_chatcmpl_for_chat_and_cmpl_for_completions(client):
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2
    )
    assert chat.id.startswith("chatcmpl-")
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=2, stream=True
        )
    )
    assert {c.id for c in chunks} == {chunks[0].id} and chunks[0].id.startswith("chatcmpl-")
    comp = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2)
    assert comp.id.startswith("cmpl-") and not comp.id.startswith("chatcmpl")


def test_unknown_model_is_404_model_not_found(live, client):
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt=PROMPT, max_tokens=2)
    assert info.value.body["code"] == "model_not_found" and info.value.body["param"] == "model"
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(
            model="gpt-17", messages=[{"role": "user", "content": "x"}], max_tokens=2
        )
    path = model_path()
    for name in (MODEL, path.name, path.stem):
        assert client.completions.create(model=name, prompt=PROMPT, max_tokens=1).choices
    r = httpx.post(f"{live.base_url}/completions", json={"prompt": PROMPT, "max_tokens": 1})  # no model
    assert r.status_code == 200


# ------------------------------------------------------------ auth, CORS


def test_bearer_scheme_in_any_case_and_preflight_is_never_401(shared_llm):
    with start_server(shared_llm, api_key="sekrit", cors_origins=("http://app.example",)) as server:
        models = f"{server.base_url}/models"
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert httpx.get(models, headers={"Authorization": f"{scheme} sekrit"}).status_code == 200
        err = assert_error_object(httpx.get(models, headers={"Authorization": "bearer wrong"}), 401)
        assert err["type"] == "authentication_error"
        assert_error_object(httpx.get(f"{server.url}/nowhere"), 401)
        preflight = {"Origin": "http://app.example", "Access-Control-Request-Method": "POST"}
        r = httpx.options(f"{server.base_url}/chat/completions", headers=preflight)
        assert r.status_code == 200
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        r = httpx.get(models, headers={"Origin": "http://app.example", "Authorization": "Bearer sekrit"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
        refused = {"Origin": "http://evil.example", "Access-Control-Request-Method": "POST"}
        assert_error_object(httpx.options(f"{server.base_url}/completions", headers=refused), 400)


def test_options_without_cors_is_not_401(shared_llm):
    with start_server(shared_llm, api_key="sekrit") as server:
        r = httpx.options(f"{server.base_url}/completions")
        assert r.status_code != 401
        assert_error_object(r, 405)


# ------------------------------------------------------------- streaming


def test_streaming_completion_logprobs_equal_the_non_streaming_ones(live, client):
    full = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2)
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 6,
        "temperature": 0,
        "logprobs": 2,
        "stream": True,
    }
    with httpx.stream("POST", f"{live.base_url}/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    chunks = [e for e in events[:-1] if isinstance(e, dict)]
    tokens, values, offsets = [], [], []
    for c in chunks:
        lp = c["choices"][0]["logprobs"]
        if lp is not None:
            tokens += lp["tokens"]
            values += lp["token_logprobs"]
            offsets += lp["text_offset"]
    want = full.choices[0].logprobs
    assert tokens == want.tokens and values == pytest.approx(want.token_logprobs)
    assert offsets == want.text_offset
    assert "".join(c["choices"][0]["text"] for c in chunks) == full.choices[0].text


def test_streaming_chat_logprobs_and_include_usage(client):
    msgs = [{"role": "user", "content": "Speak, friend."}]
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=msgs,
            max_tokens=5,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.prompt_tokens_details.cached_tokens >= 0
    assert all(c.usage is None for c in chunks[:-1])
    content = [e for c in chunks[:-1] if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert len(content) == last.usage.completion_tokens
    assert all(len(e.top_logprobs) <= 2 and e.logprob <= 0 for e in content)


def test_completion_stream_usage_chunk_comes_last_before_done(live):
    body = {
        "model": MODEL,
        "prompt": PROMPT,
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", f"{live.base_url}/completions", json=body) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk = events[-2]
    assert isinstance(usage_chunk, dict) and usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 4
    assert "cached_tokens" in usage_chunk["usage"]["prompt_tokens_details"]


def test_usage_reports_cached_prompt_tokens(live, client):
    ids = live.engine.tokenizer.encode("HAMLET: Words, words, words.")
    first = client.completions.create(
        model=MODEL, prompt=ids, max_tokens=5, temperature=0, extra_body={"return_token_ids": True}
    )
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    follow = ids + first.choices[0].model_extra["token_ids"] + live.engine.tokenizer.encode(" And")
    second = client.completions.create(model=MODEL, prompt=follow, max_tokens=2, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens == len(ids) + 5 - 1


# ------------------------------------------------------- several prompts


def test_several_prompts_are_batched_together(live, client):
    prompts = ["ROMEO:", "JULIET:", "HAMLET:"]
    alone = [client.completions.create(model=MODEL, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    steps = live.snapshot()["rsmem_decode_steps_total"]
    together = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    used = live.snapshot()["rsmem_decode_steps_total"] - steps
    assert used <= 10, f"{used} steps: the prompts ran one after another"  # one after another: >= 24
    assert [c.index for c in together.choices] == [0, 1, 2]
    assert [c.text for c in together.choices] == [a.choices[0].text for a in alone]
    assert together.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_several_prompts_are_all_or_none(live, client):
    before = live.snapshot()
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=MODEL, prompt=[[5, 6], [999_999]], max_tokens=4)
    after = live.snapshot()
    assert after["rsmem_requests_finished_total"] == before["rsmem_requests_finished_total"]
    assert after["rsmem_prompt_tokens_total"] == before["rsmem_prompt_tokens_total"]


def test_several_prompts_stream_with_their_choice_indices(live):
    body = {"model": MODEL, "prompt": ["ROMEO:", "JULIET:"], "max_tokens": 3, "n": 2, "stream": True}
    with httpx.stream("POST", f"{live.base_url}/completions", json=body) as r:
        events = sse_events(r)
    finished = {
        e["choices"][0]["index"] for e in events if isinstance(e, dict) and e["choices"][0]["finish_reason"]
    }
    assert finished == {0, 1, 2, 3} and events[-1] == "[DONE]"


# --------------------------------------------------------------- metrics


def test_metrics_labels_are_route_templates_and_404s_add_no_series(live):
    def series() -> set[str]:
        text = httpx.get(f"{live.url}/metrics").text
        return {
            line.rsplit(" ", 1)[0] for line in text.splitlines() if line.startswith("rsmem_requests_total{")
        }

    httpx.post(f"{live.url}/slots/0?action=erase")
    httpx.get(f"{live.url}/nothing-here")
    before = series()
    rng = random.Random(0)
    for _ in range(300):
        path = "/" + "".join(rng.choices(string.ascii_letters, k=12))
        assert httpx.get(f"{live.url}{path}").status_code == 404
    after = series()
    assert after == before
    assert 'rsmem_requests_total{path="other",code="404"}' in after
    assert any('path="/slots/{slot_id}"' in s for s in after)
