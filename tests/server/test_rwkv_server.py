"""The server's chat path on an RWKV model: the World tokenizer (not a ``tokenizers.Tokenizer``) gives the
token ends the prefix cache's message boundaries need, and a chat completion runs end to end, twice (the
second turn reuses the first's cached prefix)."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rsmem.engine import LLM
from rsmem.server import ServeOptions, build_app
from rsmem.server.chat import ChatTemplate
from rsmem.server.routes_openai import message_boundaries

FIXTURES = Path(__file__).parents[1] / "fixtures" / "llamacpp" / "rwkv"


@pytest.fixture(scope="module", params=["rwkv7", "rwkv6"])
def llm(request: pytest.FixtureRequest) -> LLM:
    return LLM(FIXTURES / request.param / "model-f32.gguf", n_seq_max=2, n_batch=64)


def test_rwkv_tokens_end_where_their_text_does(llm: LLM) -> None:
    tok = llm.tokenizer
    assert tok is not None
    text = "Hello, world!\n\nUser: café 你好 😀\n\n"
    ids, ends = tok.encode_with_ends(text)
    assert ids == tok.encode(text) and len(ends) == len(ids)
    assert ends == sorted(ends) and ends[-1] == len(text)
    spelled = tok.tokenizer.decode_bytes  # type: ignore[attr-defined]
    for n in range(1, len(ids) + 1):  # a token that ends inside a character ends before it
        assert spelled(ids[:n]).startswith(text[: ends[n - 1]].encode("utf-8"))


def test_rwkv_message_boundaries(llm: LLM) -> None:
    from types import SimpleNamespace

    template = ChatTemplate()
    messages = [
        {"role": "system", "content": "Be brief. Ça va, 日本語."},
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Again?"},
    ]
    prompt, prefixes = template.render(messages), template.message_prefixes(messages)
    tokens, boundaries = message_boundaries(SimpleNamespace(tokenizer=llm.tokenizer), prompt, prefixes)  # type: ignore[arg-type]
    assert llm.tokenizer is not None and tokens == llm.tokenizer.encode(prompt)
    assert boundaries == sorted(boundaries) and boundaries[0] > 0 and boundaries[-1] <= len(tokens)
    for text, n in zip(prefixes, boundaries, strict=True):  # the tokens before a boundary spell its prefix
        assert text.startswith(llm.tokenizer.decode(tokens[:n]))


def test_rwkv_chat_completion_through_the_server(llm: LLM) -> None:
    served = build_app(llm, ServeOptions(alias="rwkv", max_tokens_limit=16, model_path=None))
    messages = [{"role": "user", "content": "Hello, café 你好!"}]
    try:
        with TestClient(served.app) as client:
            for turn in range(2):
                r = client.post(
                    "/v1/chat/completions",
                    json={"model": "rwkv", "messages": messages, "max_tokens": 6, "temperature": 0},
                )
                assert r.status_code == 200, r.text
                body = r.json()
                choice = body["choices"][0]
                assert choice["message"]["role"] == "assistant"
                assert isinstance(choice["message"]["content"], str)
                assert body["usage"]["completion_tokens"] >= 1
                assert body["usage"]["prompt_tokens"] > 5
                cached = body["usage"]["prompt_tokens_details"]["cached_tokens"]
                assert (cached > 0) == (turn == 1)  # the second turn starts from the first's state
                messages += [choice["message"], {"role": "user", "content": f"And {turn}?"}]
            r = client.post(
                "/v1/chat/completions",
                json={"model": "rwkv", "messages": messages[:1], "max_tokens": 4, "stream": True},
            )
            assert r.status_code == 200 and "data: [DONE]" in r.text
    finally:
        llm.context.memory.clear()
