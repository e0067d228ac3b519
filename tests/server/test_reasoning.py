"""Reasoning: ``<think>`` text to ``reasoning_content``, split the same way whole or streamed, and
the constraint of a forced call that lets the model think first."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers.server import LiveServer, start_server
from rsmem.engine import LLM
from rsmem.engine.constraints import Constraint, ConstraintCompiler
from rsmem.server.chat import ChatTemplate
from rsmem.server.reasoning import ReasoningSplitter, after_thinking, thinking_started
from rsmem.server.tool_grammar import tool_constraint
from rsmem.server.tools import Family, ToolRequest


def split(text: str, started: bool, cuts: list[int] | None = None) -> tuple[str, str]:
    s = ReasoningSplitter(started)
    bounds = [0, *sorted(set(cuts or [])), len(text)]
    events = []
    for a, b in itertools.pairwise(bounds):
        events += s.push(text[a:b])
    events += s.finish()
    return (
        "".join(t for k, t in events if k == "reasoning"),
        "".join(t for k, t in events if k == "content"),
    )


def test_thinking_opened_by_the_prompt():
    assert split("\nLet me see.\n\n</think>\n\nParis.", True) == ("Let me see.", "Paris.")
    assert split("still thinking\n", True) == ("still thinking", "")


def test_thinking_opened_by_the_answer():
    assert split("  <think>\nhm</think>\n\nParis.", False) == ("hm", "Paris.")
    assert split("Paris. <think>no</think>", False) == ("", "Paris. <think>no</think>")
    assert split("<thin", False) == ("", "<thin")


def test_where_the_thinking_starts():
    history = "<|im_start|>user\nhi<|im_end|>\n"
    assert thinking_started(history + "<|im_start|>assistant\n<think>\n", history)
    assert not thinking_started(history + "<|im_start|>assistant\n<think>\n\n</think>\n\n", history)
    assert not thinking_started(history + "<|im_start|>assistant\n", history)


TEXTS = [("\nA </thin k>\n\n</think>\n\nB </think> C", True), (" <think>x\n</think>y", False)]


@pytest.mark.parametrize(("text", "started"), TEXTS)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_cut_splits_the_same(text: str, started: bool, data: st.DataObject):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=10))
    assert split(text, started, cuts) == split(text, started)
    assert split(text, started, list(range(len(text)))) == split(text, started)


WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def accepts(compiler: ConstraintCompiler, thinking: bool | None, text: str) -> bool:
    tools = ToolRequest((), {"weather": WEATHER}, "required", None, True, Family.HERMES)
    matcher = compiler.compile(tool_constraint(tools, thinking)).matcher()
    for token in compiler.tokenizer.encode(text) if compiler.tokenizer else ():
        if not matcher.llmatcher.consume_token(token):
            return False
    return matcher.llmatcher.is_accepting()


def test_a_forced_call_comes_after_the_thinking(shared_llm: LLM):
    compiler = ConstraintCompiler(shared_llm.tokenizer, shared_llm.context.n_vocab)
    assert accepts(compiler, True, "Oslo, surely. </thinking> <think>\n</think>\n\n" + CALL)
    assert not accepts(compiler, True, CALL)  # the prompt opened <think>: it must be closed first
    assert not accepts(compiler, True, "hm</think>\n\nSunny.")
    assert accepts(compiler, False, CALL)
    assert accepts(compiler, False, "<think>hm</think>\n" + CALL)
    assert not accepts(compiler, None, "<think>hm</think>\n" + CALL)
    assert not accepts(compiler, None, CALL.replace("Oslo", "Rome"))


@pytest.mark.parametrize(
    ("constraint", "answer", "wrong"),
    [
        (
            Constraint.json_schema({"type": "object", "properties": {"a": {"const": 1}}, "required": ["a"]}),
            '{"a":1}',
            '{"a":2}',
        ),
        (Constraint.json_object(), '{"b":[]}', "[]"),
        (Constraint.regex("[0-9]{2}/x"), "42/x", "4/x"),
        (Constraint.choice(["yes", "no"]), "no", "maybe"),
        (Constraint.grammar('root ::= "{" root? "}"'), "{{}}", "{{}"),
        (Constraint.lark('start: "x" %json{"type": "integer"}'), "x12", "x1.5"),
    ],
)
def test_a_response_format_applies_after_the_thinking(shared_llm: LLM, constraint, answer, wrong):
    compiler = ConstraintCompiler(shared_llm.tokenizer, shared_llm.context.n_vocab)

    def ok(c: Constraint, text: str) -> bool:
        matcher = compiler.compile(c).matcher()
        for token in shared_llm.tokenizer.encode(text):
            if not matcher.llmatcher.consume_token(token):
                return False
        return matcher.llmatcher.is_accepting()

    started, optional = after_thinking(constraint, True), after_thinking(constraint, False)
    assert started.field == constraint.field
    assert ok(started, "Hm, {x} </think>\n\n" + answer) and not ok(started, answer)
    assert not ok(started, "Hm</think>\n" + wrong)
    assert ok(optional, answer) and ok(optional, "<think>x</think>" + answer)
    assert not ok(optional, "<think>x</think>" + wrong)


# A Qwen3.5-like template: the generation prompt opens the thinking
THINKING = """{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
<think>
{% endif %}"""


@pytest.fixture(scope="module")
def thinker(shared_llm: LLM) -> Iterator[LiveServer]:
    with start_server(shared_llm, max_prompt_tokens=4000, max_tokens_limit=256) as server:
        server.settings.chat_template = ChatTemplate(THINKING, eos_token="</s>")
        yield server


def post(live: LiveServer, **body: Any) -> httpx.Response:
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Weather?"},
    ]
    payload = {"messages": messages, "max_tokens": 30, "seed": 5, "temperature": 1.0} | body
    return httpx.post(f"{live.base_url}/chat/completions", json=payload, timeout=120)


def test_reasoning_content_whole_and_streamed(thinker: LiveServer):
    r = post(thinker)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"]  # the tiny model does not close its thinking in 30 tokens
    reasoning, content = "", ""
    with httpx.stream(
        "POST",
        f"{thinker.base_url}/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}], "stream": True}
        | {"max_tokens": 30, "seed": 5, "temperature": 1.0},
        timeout=120,
    ) as s:
        streamed = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    whole = post(thinker, messages=[{"role": "user", "content": "Hi"}]).json()["choices"][0]["message"]
    for event in streamed:
        delta = event["choices"][0]["delta"]
        reasoning += delta.get("reasoning_content") or ""
        content += delta.get("content") or ""
    assert reasoning == whole["reasoning_content"]
    assert (content or None) == whole["content"]


def test_a_response_format_on_a_thinking_template(thinker: LiveServer):
    """The model thinks first (the tiny one does not stop in 30 tokens): reasoning, no content; a
    grammar that does not parse is still refused, naming its field."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}
    r = post(thinker, response_format=fmt)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    assert message["reasoning_content"] and message["content"] is None
    bad = post(thinker, grammar="root ::= undefined")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "grammar", bad.text
