"""``echo`` on ``/v1/completions``, as OpenAI's legacy completions API answers it: a stream sends each
choice's prompt first, and ``text_offset`` counts from the start of the echoed text, streaming or not."""

from __future__ import annotations

import json

import httpx
import pytest

from helpers.server import MODEL

pytestmark = pytest.mark.subprocess

PROMPT = "ROMEO:"


def complete(live, **fields) -> dict:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0} | fields
    r = httpx.post(f"{live.base_url}/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def stream(live, **fields) -> list[dict]:
    """The stream's chunks (the data events before ``[DONE]``)."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0, "stream": True} | fields
    chunks = []
    with httpx.stream("POST", f"{live.base_url}/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line.removeprefix("data: ")))
    return chunks


def texts_by_choice(chunks: list[dict]) -> dict[int, list[str]]:
    texts: dict[int, list[str]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts.setdefault(choice["index"], []).append(choice["text"])
    return texts


def test_a_stream_with_echo_sends_the_prompt_first(live) -> None:
    whole = complete(live, echo=True)["choices"][0]["text"]
    assert whole.startswith(PROMPT) and len(whole) > len(PROMPT)
    chunks = stream(live, echo=True)
    first = chunks[0]["choices"][0]
    assert (first["index"], first["text"], first["finish_reason"]) == (0, PROMPT, None)
    assert "".join(texts_by_choice(chunks)[0]) == whole
    assert "".join(texts_by_choice(stream(live))[0]) == whole[len(PROMPT) :]  # without echo: no prompt


def test_each_choice_of_each_prompt_echoes_its_own_prompt(live) -> None:
    prompts = ["ROMEO:", "JULIET:"]
    chunks = stream(live, prompt=prompts, n=2, echo=True)
    texts = texts_by_choice(chunks)
    assert sorted(texts) == [0, 1, 2, 3]
    for index, parts in texts.items():
        assert parts[0] == prompts[index // 2]
    openings = [c["choices"][0]["index"] for c in chunks[:4]]
    assert openings == [0, 1, 2, 3]  # every prompt before any token


def test_text_offset_counts_from_the_echoed_text(live) -> None:
    choice = complete(live, echo=True, logprobs=1)["choices"][0]
    text, lps = choice["text"], choice["logprobs"]
    assert lps["text_offset"][0] == len(PROMPT)
    for offset, token in zip(lps["text_offset"], lps["tokens"], strict=True):
        assert text[offset : offset + len(token)] == token
    plain = complete(live, logprobs=1)["choices"][0]["logprobs"]
    assert plain["text_offset"][0] == 0
    assert lps["text_offset"] == [o + len(PROMPT) for o in plain["text_offset"]]
    streamed = [
        o
        for chunk in stream(live, echo=True, logprobs=1)
        for c in chunk["choices"]
        if c["logprobs"] is not None
        for o in c["logprobs"]["text_offset"]
    ]
    assert streamed == lps["text_offset"]
