"""Structured outputs through the server: every way of asking (OpenAI's ``response_format``,
llama-server's ``grammar``/``json_schema``, vLLM's ``structured_outputs``/``guided_*``), streamed or
not, with ``n > 1``; answers checked with jsonschema and re. What cannot be enforced, and fields the
server does not implement, are a 400 naming the field."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from helpers.server import MODEL, LiveServer

pytestmark = pytest.mark.subprocess

# every string and number bounded: an answer always ends well within the server's 64-token limit
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 99},
        "mood": {"enum": ["glad", "sad"]},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "mood", "ok"],
    "additionalProperties": False,
}
MESSAGES = [{"role": "user", "content": "Who art thou?"}]


@pytest.fixture
def client(live: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=live.base_url, api_key="unused", max_retries=0)


def post(live: LiveServer, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{live.base_url}/{route}", json={"model": MODEL, **body}, timeout=60)


def stream_texts(live: LiveServer, route: str, body: dict[str, Any]) -> dict[int, str]:
    """Each choice's text, joined from a stream's deltas (every choice must end with stop)."""
    texts: dict[int, str] = {}
    ends: dict[int, str] = {}
    with httpx.stream(
        "POST", f"{live.base_url}/{route}", json={"model": MODEL, "stream": True, **body}, timeout=60
    ) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            for choice in json.loads(line[6:])["choices"]:
                delta = choice["delta"].get("content") if "delta" in choice else choice.get("text")
                texts[choice["index"]] = texts.get(choice["index"], "") + (delta or "")
                if choice.get("finish_reason"):
                    ends[choice["index"]] = choice["finish_reason"]
    assert set(ends.values()) == {"stop"}, ends
    return texts


def test_chat_json_schema_with_forks(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model=MODEL,
        messages=MESSAGES,
        n=3,
        temperature=1.0,
        seed=5,
        max_tokens=64,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "who", "schema": SCHEMA, "strict": True},
        },
    )
    assert len(r.choices) == 3
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_chat_stream_reassembles_to_the_same_valid_answer(live: LiveServer) -> None:
    body = {
        "messages": MESSAGES,
        "n": 2,
        "seed": 11,
        "temperature": 0.9,
        "max_tokens": 64,
        "response_format": {"type": "json_schema", "json_schema": {"name": "who", "schema": SCHEMA}},
    }
    whole = post(live, "chat/completions", body).json()
    streamed = stream_texts(live, "chat/completions", body)
    for choice in whole["choices"]:
        assert streamed[choice["index"]] == choice["message"]["content"]
        jsonschema.validate(json.loads(choice["message"]["content"]), SCHEMA)


@pytest.mark.parametrize(
    ("fields", "pattern"),
    [
        ({"grammar": 'root ::= ("yes" | "no") ", " [a-z]{1,6} "."'}, r"(yes|no), [a-z]{1,6}\."),
        ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,5} [0-9]{1,2}"}}, r"[A-Z][a-z]{2,5} [0-9]{1,2}"),
        ({"structured_outputs": {"choice": ["ROMEO", "JULIET"]}}, r"ROMEO|JULIET"),
        ({"structured_outputs": {"grammar": 'root ::= "<" [a-z]{1,4} ">"'}}, r"<[a-z]{1,4}>"),
        ({"guided_regex": r"[0-9]{3}-[0-9]{2}"}, r"[0-9]{3}-[0-9]{2}"),
        ({"guided_choice": ["a", "b c"]}, r"a|b c"),
        ({"guided_grammar": 'root ::= "x" [0-9]'}, r"x[0-9]"),
    ],
)
def test_completion_grammars_streamed_and_not(live: LiveServer, fields: dict[str, Any], pattern: str) -> None:
    body = {"prompt": "ROMEO:", "n": 2, "seed": 3, "temperature": 1.0, "max_tokens": 32, **fields}
    r = post(live, "completions", body)
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert choice["finish_reason"] == "stop"
        assert re.fullmatch(pattern, choice["text"]), choice["text"]
    streamed = stream_texts(live, "completions", body)
    assert [streamed[c["index"]] for c in r.json()["choices"]] == [c["text"] for c in r.json()["choices"]]


@pytest.mark.parametrize(
    "fields",
    [
        {"json_schema": SCHEMA},
        {"response_format": {"type": "json_object", "schema": SCHEMA}},
        {"response_format": {"type": "json_schema", "schema": SCHEMA}},
        {"structured_outputs": {"json": SCHEMA}},
        {"structured_outputs": {"json": json.dumps(SCHEMA)}},
        {"guided_json": SCHEMA},
    ],
)
def test_every_json_schema_field_is_enforced(live: LiveServer, fields: dict[str, Any]) -> None:
    r = post(live, "completions", {"prompt": "KING:", "max_tokens": 64, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    jsonschema.validate(json.loads(choice["text"]), SCHEMA)


def test_json_object_mode(live: LiveServer) -> None:
    body = {"messages": MESSAGES, "max_tokens": 64, "seed": 1, "response_format": {"type": "json_object"}}
    choice = post(live, "chat/completions", body).json()["choices"][0]
    text = choice["message"]["content"]
    assert text.startswith("{")
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(text), dict)
    else:
        assert choice["finish_reason"] == "length"


def test_a_constraint_drops_the_chat_templates_stop(live: LiveServer) -> None:
    """The plain template stops at "\\nUser:"; under a constraint the grammar decides the end."""
    body = {"messages": MESSAGES, "max_tokens": 32, "grammar": 'root ::= "a\\nUser: b"'}
    choice = post(live, "chat/completions", body).json()["choices"][0]
    assert (choice["message"]["content"], choice["finish_reason"]) == ("a\nUser: b", "stop")


def test_neutral_values_of_unimplemented_fields_are_accepted(live: LiveServer) -> None:
    body = {
        "prompt": "ROMEO:",
        "max_tokens": 2,
        "suffix": "",
        "best_of": 1,
        "response_format": {"type": "text"},
    }
    assert post(live, "completions", body).status_code == 200
    body = {"messages": MESSAGES, "max_tokens": 2, "modalities": ["text"], "mirostat": 0}
    assert post(live, "chat/completions", body).status_code == 200


@pytest.mark.parametrize(
    ("fields", "param", "words"),
    [
        ({"grammar": 'root ::= "a"', "json_schema": SCHEMA}, "json_schema", "grammar, json_schema"),
        (
            {"response_format": {"type": "json_object"}, "structured_outputs": {"choice": ["a"]}},
            "structured_outputs.choice",
            "response_format",
        ),
        ({"json_schema": {"type": "array", "uniqueItems": True}}, "json_schema", "uniqueItems"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format.json_schema.schema",
            "not",
        ),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
            "response_format.json_schema",
            "schema",
        ),
        ({"response_format": {"type": "yaml"}}, "response_format.type", ""),
        ({"grammar": "root ::= undefined_rule"}, "grammar", "undefined_rule"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "non-empty"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag", ""),
        ({"guided_json": "{not json"}, "guided_json", "JSON"),
        ({"grammar": 'root ::= "a"', "stop": ["x"]}, "stop", "constraint"),
        ({"suffix": "the end"}, "suffix", "suffix"),
        ({"best_of": 3}, "best_of", "n"),
        ({"n_predict": 5}, "n_predict", "max_tokens"),
        ({"typical_p": 0.5}, "typical_p", "typical"),
        ({"use_beam_search": True}, "use_beam_search", "beam"),
    ],
)
def test_refusals_name_the_field(live: LiveServer, fields: dict[str, Any], param: str, words: str) -> None:
    r = post(live, "completions", {"prompt": "ROMEO:", "max_tokens": 8, **fields})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param
    assert words in error["message"]


def test_chat_refusals(live: LiveServer) -> None:
    for fields, param in [
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "foo"}},
                }
            },
            None,
        ),
    ]:
        r = post(live, "chat/completions", {"messages": MESSAGES, "max_tokens": 4, "stream": True, **fields})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == (param or "response_format.json_schema.schema")
