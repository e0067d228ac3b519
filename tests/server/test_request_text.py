"""Text that is not Unicode (a lone UTF-16 surrogate, which JSON's ``\\ud800`` escapes can carry) is a 400
naming its JSON field, never a 500; the Python API refuses it with InvalidRequestError naming ``prompt``."""

from __future__ import annotations

import httpx
import pytest

from helpers.server import MODEL, model_path
from rsmem.engine import LLM, SamplingParams
from rsmem.errors import InvalidRequestError

pytestmark = pytest.mark.subprocess

CHAT = "/chat/completions"
CASES = [
    ("/completions", r'{"prompt": "ROMEO \ud800 x"}', "prompt", "U+D800 at character 6"),
    ("/completions", r'{"prompt": ["ROMEO:", "x\udc00"]}', "prompt[1]", "U+DC00 at character 1"),
    ("/completions", r'{"prompt": "ROMEO:", "stop": "\ud800"}', "stop", "U+D800 at character 0"),
    ("/completions", r'{"prompt": "ROMEO:", "stop": ["\n", "a\ud83d"]}', "stop[1]", "U+D83D at character 1"),
    (
        CHAT,
        r'{"messages": [{"role": "user", "content": "hi \udc00"}]}',
        "messages[0].content",
        "U+DC00 at character 3",
    ),
    (
        CHAT,
        r'{"messages": [{"role": "system", "content": "be brief"},'
        r' {"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]}',
        "messages[1].content[0].text",
        "U+D800 at character 0",
    ),
    (
        CHAT,
        r'{"model": "m\ud800", "messages": [{"role": "user", "content": "hi"}]}',
        "model",
        "U+D800 at character 1",
    ),
]


def post(live, path: str, body: str) -> httpx.Response:
    """``body`` is raw JSON text (httpx's own encoder cannot write a lone surrogate)."""
    headers = {"Content-Type": "application/json"}
    return httpx.post(f"{live.base_url}{path}", content=body.encode(), headers=headers, timeout=30)


@pytest.mark.parametrize(("path", "body", "param", "where"), CASES, ids=[c[2] for c in CASES])
def test_a_lone_surrogate_is_a_400_naming_the_field(live, path: str, body: str, param: str, where: str):
    r = post(live, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    where = where.replace(" char ", " character ")
    assert err["message"] == f"{param} is not valid Unicode text: a lone surrogate {where}"


def test_a_surrogate_pair_is_text_and_is_served(live) -> None:
    body = f'{{"model": "{MODEL}", "prompt": "ROMEO \\ud83d\\ude00:", "max_tokens": 2}}'
    r = post(live, "/completions", body)
    assert r.status_code == 200, r.text


def test_validation_locations_are_json_paths(live) -> None:
    r = post(live, CHAT, r'{"messages": [{"role": "user", "content": "hi"}, {"role": "robot"}]}')
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "messages[1].role"


@pytest.fixture(scope="module")
def small_llm() -> LLM:
    return LLM(model_path(), n_seq_max=1)


def test_the_python_api_refuses_it_naming_the_prompt(small_llm: LLM) -> None:
    with pytest.raises(
        InvalidRequestError, match=r"^prompt .*is not valid Unicode text: a lone surrogate U\+D800"
    ):
        small_llm.generate("ROMEO \ud800 x", SamplingParams.greedy(max_tokens=2))
    tokenizer = small_llm.engine.tokenizer
    assert tokenizer is not None
    with pytest.raises(InvalidRequestError) as caught:
        tokenizer.encode_with_ends("\udc00", "messages")
    assert caught.value.param == "messages"
    # the engine is as it was: the next request runs
    out = small_llm.generate("ROMEO:", SamplingParams.greedy(max_tokens=2))
    assert len(out[0].outputs[0].token_ids) == 2
