"""The call parser of each family: calls and content out of the model's text, the same whichever way
the text is cut into stream deltas, and malformed calls left as content."""

from __future__ import annotations

import itertools
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rsmem.server.tool_parser import CallParser, ParsedCall
from rsmem.server.tools import Family


def parse(family: Family, text: str, cuts: list[int] | None = None, parallel: bool = True):
    """(content or None, calls) of ``text`` pushed in pieces cut at ``cuts`` (whole when None)."""
    p = CallParser(family, parallel, {"weather": WEATHER})
    bounds = [0, *sorted(set(cuts or [])), len(text)]
    events = []
    for a, b in itertools.pairwise(bounds):
        events += p.push(text[a:b])
    events += p.finish()
    content = "".join(v for k, v in events if k == "content" and isinstance(v, str))
    return content or None, [v for _, v in events if isinstance(v, ParsedCall)]


def call(name: str, **args: object) -> ParsedCall:
    return ParsedCall(name, json.dumps(args))


HERMES = (
    "Let me look.\n"
    '<tool_call>\n{"name": "weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
    '<tool_call>\n{"name": "time", "arguments": "{\\"zone\\": \\"CET\\"}"}\n</tool_call>'
)
LFM2 = (
    "<|tool_call_start|>[weather(city=\"Paris\", days=2), tz.time(zone='CET', dst=true, x=-1.5)]"
    "<|tool_call_end|>Checking."
)
GENERIC = ' {"tool_calls": [{"name": "weather", "arguments": {"city": "Paris", "days": 2}}]}'
QWEN_XML = (
    "Looking.\n<tool_call>\n<function=weather>\n<parameter=city>\nNew\nYork\n</parameter>\n"
    "<parameter=days>\n2\n</parameter>\n<parameter=metric>\nTrue\n</parameter>\n</function>\n</tool_call>"
)
WEATHER = {"properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}
CASES = [(Family.HERMES, HERMES), (Family.LFM2, LFM2), (Family.GENERIC, GENERIC), (Family.QWEN_XML, QWEN_XML)]


def test_hermes_calls_and_content():
    content, calls = parse(Family.HERMES, HERMES)
    assert content == "Let me look.\n\n"
    assert calls == [call("weather", city="Paris", days=2), call("time", zone="CET")]


def test_lfm2_python_calls():
    content, calls = parse(Family.LFM2, LFM2)
    assert content == "Checking."
    assert calls == [call("weather", city="Paris", days=2), call("tz.time", zone="CET", dst=True, x=-1.5)]


def test_lfm2_json_calls():
    text = '<|tool_call_start|>[{"name": "f", "arguments": {"a": [1, null]}}]<|tool_call_end|>'
    assert parse(Family.LFM2, text) == (None, [call("f", a=[1, None])])


def test_qwen_xml_calls_read_values_by_their_schema():
    content, calls = parse(Family.QWEN_XML, QWEN_XML)
    assert content == "Looking.\n"
    assert calls == [call("weather", city="New\nYork", days=2, metric=True)]
    params = "<parameter=a>\n[1, {}]\n</parameter>\n<parameter=b>\nnot json\n</parameter>\n"
    text = f"<tool_call>\n<function=f>\n{params}</function>\n</tool_call>"
    assert parse(Family.QWEN_XML, text) == (None, [call("f", a=[1, {}], b="not json")])


def test_generic_call_and_response():
    assert parse(Family.GENERIC, GENERIC) == (None, [call("weather", city="Paris", days=2)])
    one = '{"tool_call": {"name": "f", "arguments": {}}}'
    assert parse(Family.GENERIC, one) == (None, [call("f")])
    assert parse(Family.GENERIC, '{"response": "Hello there"}') == ("Hello there", [])
    assert parse(Family.GENERIC, "Just text {not json}") == ("Just text {not json}", [])


@pytest.mark.parametrize(
    ("family", "text"),
    [
        (Family.HERMES, "<tool_call>\n{not json}\n</tool_call>"),
        (Family.HERMES, '<tool_call>{"name": 3, "arguments": {}}</tool_call>'),
        (Family.HERMES, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'),
        (Family.HERMES, '<tool_call>{"name": "f", "arguments": {}, "x": 1}</tool_call>'),
        (Family.HERMES, '<tool_call>{"name": "f", "arguments": {}}'),  # never closed
        (Family.QWEN_XML, "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>"),
        (Family.QWEN_XML, "<tool_call>\n<function=f>\nstray\n</function>\n</tool_call>"),
        (Family.QWEN_XML, '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'),
        (Family.LFM2, "<|tool_call_start|>[f(1, 2)]<|tool_call_end|>"),  # positional arguments
        (Family.LFM2, "<|tool_call_start|>[f(a=g())]<|tool_call_end|>"),  # not a literal
        (Family.LFM2, "<|tool_call_start|>[f(a=1]<|tool_call_end|>"),
        (Family.LFM2, "<|tool_call_start|>[]<|tool_call_end|>"),
        (Family.GENERIC, '{"tool_call": {"name": "f"}, "response": "x"}'),
        (Family.GENERIC, '{"tool_calls": []}'),
        (Family.GENERIC, '{"tool_call": {"name": "f", "arguments": {}}'),  # cut short
    ],
)
def test_malformed_calls_stay_content(family: Family, text: str):
    assert parse(family, text) == (text, [])


def test_a_malformed_block_stays_content_beside_a_good_one():
    text = 'A<tool_call>{"name": "f"}</tool_call>B<tool_call>oops</tool_call>'
    assert parse(Family.HERMES, text) == ("AB<tool_call>oops</tool_call>", [call("f")])


def test_without_parallel_calls_the_first_call_ends_parsing():
    content, calls = parse(Family.HERMES, HERMES, parallel=False)
    assert calls == [call("weather", city="Paris", days=2)]
    assert content is not None and content.endswith('"CET\\"}"}\n</tool_call>')
    text = "<|tool_call_start|>[f(), g()]<|tool_call_end|>"
    assert parse(Family.LFM2, text, parallel=False) == (text, [])
    assert parse(Family.GENERIC, '{"tool_calls": [{"name": "f"}, {"name": "g"}]}', parallel=False)[1] == []


def test_blank_content_is_none():
    assert parse(Family.HERMES, '\n <tool_call>{"name": "f"}</tool_call>\n\n') == (None, [call("f")])
    assert parse(Family.GENERIC, "  \n") == (None, [])


def test_text_like_a_marker_is_held_then_given_back():
    p = CallParser(Family.HERMES)
    assert p.push("a <tool_") == [("content", "a ")]
    assert p.push("cal") == []
    assert p.push("m") == [("content", "<tool_calm")]


@pytest.mark.parametrize(("family", "text"), CASES)
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_any_cut_of_the_text_parses_the_same(family: Family, text: str, data: st.DataObject):
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    assert parse(family, text, cuts) == parse(family, text)
    assert parse(family, text, list(range(len(text)))) == parse(family, text)
