"""Tool calls through the server on the embedded model (a tiny model: only the constraint makes its
calls valid): ``tool_choice`` required and named always answer calls whose arguments validate, streams
reassemble to the JSON answer, and what cannot be honoured is a 400 naming the field. The families'
templates are small Jinja templates written here (the fixtures carry none)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
import jsonschema
import pytest

from helpers.server import LiveServer, start_server
from rsmem.engine import LLM
from rsmem.server.chat import ChatTemplate

pytestmark = pytest.mark.subprocess

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "weather", "description": "The forecast", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "time", "parameters": TIME}},
]
SCHEMAS = {"weather": WEATHER, "time": TIME}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]

# Qwen's Hermes-style template, cut down: tools in the system turn, calls as <tool_call> JSON
HERMES = """{%- if tools %}<|im_start|>system
# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
For each function call, return a json object within <tool_call></tool_call> XML tags.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def live(shared_llm: LLM) -> Iterator[LiveServer]:
    with start_server(shared_llm, max_prompt_tokens=4000, max_tokens_limit=256) as server:
        yield server


# LFM2's tool part: the tools listed in the system turn, calls between <|tool_call_start|> markers
LFM2 = """{%- if tools %}<|im_start|>system
List of tools: <|tool_list_start|>{{ tools | tojson }}<|tool_list_end|><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
# Qwen3.5's tool part, cut down: calls as <tool_call><function=...><parameter=...> XML
QWEN_XML = """{%- if tools %}<|im_start|>system
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools>
Call: <tool_call>\n<function=f>\n<parameter=k>\nv\n</parameter>\n</function>\n</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
<function={{ tc.function.name }}>
{% for k, v in tc.function.arguments | items %}<parameter={{ k }}>
{{ v if v is string else v | tojson }}
</parameter>
{% endfor %}</function>
</tool_call>
{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TEMPLATES = {"hermes": HERMES, "lfm2": LFM2, "qwen_xml": QWEN_XML}


@contextmanager
def serving(live: LiveServer, family: str) -> Iterator[LiveServer]:
    """The server with the family's template (the plain one for ``generic``)."""
    plain = live.settings.chat_template
    if family in TEMPLATES:
        live.settings.chat_template = ChatTemplate(TEMPLATES[family], eos_token="</s>")
    try:
        yield live
    finally:
        live.settings.chat_template = plain


@pytest.fixture
def hermes(live: LiveServer) -> Iterator[LiveServer]:
    with serving(live, "hermes") as server:
        yield server


def chat(live: LiveServer, **body: Any) -> httpx.Response:
    payload = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "seed": 7} | body
    return httpx.post(f"{live.base_url}/chat/completions", json=payload, timeout=120)


def stream(live: LiveServer, **body: Any) -> list[dict[str, Any]]:
    payload = {"messages": ASK, "tools": TOOLS, "max_tokens": 200, "seed": 7, "stream": True} | body
    events = []
    with httpx.stream("POST", f"{live.base_url}/chat/completions", json=payload, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    return events


def reassembled(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Each choice's message and finish reason, put together from stream chunks as clients do."""
    out: dict[int, dict[str, Any]] = {}
    for event in events:
        assert "error" not in event, event
        for choice in event["choices"]:
            m = out.setdefault(choice["index"], {"content": None, "tool_calls": {}, "finish_reason": None})
            delta = choice["delta"]
            if delta.get("content"):
                m["content"] = (m["content"] or "") + delta["content"]
            for call in delta.get("tool_calls") or ():
                slot = m["tool_calls"].setdefault(call["index"], {"name": None, "arguments": ""})
                if "id" in call:
                    assert call["id"].startswith("call_") and call["type"] == "function"
                    slot["name"] = call["function"]["name"]
                slot["arguments"] += call["function"].get("arguments", "")
            if choice["finish_reason"] is not None:
                m["finish_reason"] = choice["finish_reason"]
    return out


def calls_of(message: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or ()]


def streamed_calls(got: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["name"], c["arguments"]) for c in got["tool_calls"].values()]


def check_calls(message: dict[str, Any], names: set[str]) -> None:
    calls = message["tool_calls"]
    assert calls, message
    for call in calls:
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), SCHEMAS[call["function"]["name"]])


@pytest.mark.parametrize("family", ["generic", "hermes", "lfm2"])
def test_required_calls_validate_and_stream_the_same(live: LiveServer, family: str) -> None:
    with serving(live, family) as server:
        required_calls_validate_and_stream_the_same(server)


def required_calls_validate_and_stream_the_same(server: LiveServer) -> None:
    r = chat(server, tool_choice="required", n=2, parallel_tool_calls=False)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    for choice in choices:
        assert choice["finish_reason"] == "tool_calls"
        check_calls(choice["message"], {"weather", "time"})
        assert len(choice["message"]["tool_calls"]) == 1
    streamed = reassembled(stream(server, tool_choice="required", n=2, parallel_tool_calls=False))
    for choice in choices:
        got = streamed[choice["index"]]
        assert got["finish_reason"] == "tool_calls"
        assert streamed_calls(got) == calls_of(choice["message"])
        assert got["content"] == choice["message"]["content"]


def test_parallel_calls_validate_unless_cut_by_max_tokens(hermes: LiveServer) -> None:
    """The tiny model may go on calling: an answer cut by ``max_tokens`` says ``length``, and what
    it completed before the cut is still valid text of the grammar (not a call)."""
    r = chat(hermes, tool_choice="required", seed=11)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    if choice["finish_reason"] == "tool_calls":
        check_calls(choice["message"], {"weather", "time"})
    else:  # the calls completed before the cut are calls; the cut one stays text
        assert choice["finish_reason"] == "length"
        assert choice["message"]["content"].lstrip().startswith("<tool_call>")
        if choice["message"].get("tool_calls"):
            check_calls(choice["message"], {"weather", "time"})
    got = reassembled(stream(hermes, tool_choice="required", seed=11))[0]
    assert streamed_calls(got) == calls_of(choice["message"])
    assert got["content"] == choice["message"]["content"]


@pytest.mark.parametrize("family", ["generic", "hermes", "lfm2"])
def test_named_choice_calls_that_function_once(live: LiveServer, family: str) -> None:
    named = {"type": "function", "function": {"name": "time"}}
    with serving(live, family) as server:
        r = chat(server, tool_choice=named, parallel_tool_calls=False, temperature=1.5, seed=3)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    check_calls(message, {"time"})
    assert len(message["tool_calls"]) == 1


def test_auto_streams_what_the_json_answer_says(hermes: LiveServer) -> None:
    """The model's own text (no constraint): the stream and the JSON answer read it the same way."""
    for seed in (1, 2):
        r = chat(hermes, temperature=1.0, seed=seed, max_tokens=40)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        got = reassembled(stream(hermes, temperature=1.0, seed=seed, max_tokens=40))[0]
        assert got["content"] == choice["message"]["content"]
        assert streamed_calls(got) == calls_of(choice["message"])
        assert got["finish_reason"] == choice["finish_reason"]


def test_a_conversation_with_calls_and_results_renders(hermes: LiveServer) -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "weather", "arguments": '{"city": "Oslo"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    r = chat(hermes, messages=messages, tool_choice="none", max_tokens=4)
    assert r.status_code == 200, r.text
    assert "tool_calls" not in r.json()["choices"][0]["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tool_choice": "required", "tools": None}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]}, None),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
            None,
        ),
        ({"tools": [*TOOLS, TOOLS[0]]}, "tools[2].function.name"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tool_choice": "required", "stop": ["x"]}, "stop"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
        ),
    ],
)
def test_what_cannot_be_honoured_is_refused(
    live: LiveServer, body: dict[str, Any], param: str | None
) -> None:
    r = chat(live, **body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == (param or "tools[0].function.parameters"), error


def test_a_schema_the_engine_cannot_enforce_is_refused(live: LiveServer) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "not": {}}}}]
    r = chat(live, tools=tools, tool_choice="required")
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "tools"


def test_qwen_xml_calls_validate_and_stream_the_same(live: LiveServer) -> None:
    """Qwen's XML form: enum and JSON-typed parameters under the grammar; a string ``pattern`` it
    cannot enforce in that form is refused."""
    with serving(live, "qwen_xml") as server:
        body = {"tools": TOOLS[:1], "tool_choice": "required", "parallel_tool_calls": False, "n": 2}
        r = chat(server, **body)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "tool_calls"
            check_calls(choice["message"], {"weather"})
        streamed = reassembled(stream(server, **body))
        for choice in r.json()["choices"]:
            assert streamed_calls(streamed[choice["index"]]) == calls_of(choice["message"])
        refused = chat(server, tool_choice="required")
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "tools", refused.text
        assert "pattern" in refused.json()["error"]["message"]
