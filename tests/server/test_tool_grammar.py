"""The grammar of a forced call, for each family: what it accepts is a call the family's parser reads,
with arguments that validate; what breaks the schema or the syntax is refused token by token; and
Qwen's XML form refuses (400 naming ``tools``) what it cannot enforce."""

from __future__ import annotations

import json

import jsonschema
import pytest

from rsmem.engine import LLM
from rsmem.engine.constraints import ConstraintCompiler
from rsmem.errors import InvalidRequestError
from rsmem.server.tool_grammar import tool_constraint
from rsmem.server.tool_parser import CallParser
from rsmem.server.tools import Family, ToolRequest

NOTE = {
    "type": "object",
    "properties": {
        "text": {"type": "string"},
        "level": {"type": "string", "enum": ["low", "high"]},
        "tags": {"type": "array", "items": {"type": "integer"}, "maxItems": 2},
    },
    "required": ["text", "tags"],
}
GOOD_ARGS = {"text": "Buy </param> milk\nand eggs", "tags": [1, 2]}

GOOD = {
    Family.HERMES: '<tool_call>\n{"name": "note", "arguments": {"text": "Buy </param> milk\\nand eggs", '
    '"tags": [1, 2]}}\n</tool_call>',
    Family.LFM2: '<|tool_call_start|>[{"name": "note", "arguments": {"text": "Buy </param> milk\\nand eggs", '
    '"tags": [1, 2]}}]<|tool_call_end|>',
    Family.GENERIC: '{"tool_call": {"name": "note", "arguments": {"text": "Buy </param> milk\\nand eggs", '
    '"tags": [1, 2]}}}',
    Family.QWEN_XML: "<tool_call>\n<function=note>\n"
    "<parameter=text>\nBuy </param> milk\nand eggs\n</parameter>\n"
    "<parameter=tags>\n[1, 2]\n</parameter>\n</function>\n</tool_call>",
}


@pytest.fixture(scope="module")
def compiler(shared_llm: LLM) -> ConstraintCompiler:
    return ConstraintCompiler(shared_llm.tokenizer, shared_llm.context.n_vocab)


def request(family: Family, functions: dict | None = None) -> ToolRequest:
    return ToolRequest((), functions or {"note": NOTE}, "required", None, False, family)


def accepts(compiler: ConstraintCompiler, tools: ToolRequest, text: str) -> bool:
    matcher = compiler.compile(tool_constraint(tools, None)).matcher()
    assert compiler.tokenizer is not None
    for token in compiler.tokenizer.encode(text):
        if not matcher.llmatcher.consume_token(token):
            return False
    return matcher.llmatcher.is_accepting()


@pytest.mark.parametrize("family", list(GOOD))
def test_what_the_grammar_accepts_parses_and_validates(compiler: ConstraintCompiler, family: Family):
    tools = request(family)
    text = GOOD[family]
    assert accepts(compiler, tools, text)
    parser = CallParser(family, False, tools.functions)
    events = parser.push(text) + parser.finish()
    assert [k for k, _ in events] == ["call"]
    args = json.loads(events[0][1].arguments)  # type: ignore[union-attr]
    assert args == GOOD_ARGS
    jsonschema.validate(args, NOTE)


@pytest.mark.parametrize("family", list(GOOD))
def test_what_breaks_the_schema_or_the_syntax_is_refused(compiler: ConstraintCompiler, family: Family):
    tools = request(family)
    text = GOOD[family]
    for wrong in (
        text.replace("[1, 2]", "[1, 2, 3]"),  # maxItems
        text.replace("note", "nope", 1),  # not a tool
        text.replace("[1, 2]", '["1"]'),  # items are integers
        text[:-3],  # cut short
        "Sure. " + text,  # text before the call
    ):
        assert not accepts(compiler, tools, wrong), wrong


def test_qwen_xml_refuses_what_it_cannot_enforce(compiler: ConstraintCompiler):
    for parameters in (
        {"type": "object", "properties": {"a": {"type": "string", "maxLength": 3}}},
        {"type": "object", "properties": {"a": {"type": "string", "enum": [1]}}},
        {"type": "object", "anyOf": [{"required": ["a"]}], "properties": {"a": {"type": "integer"}}},
        {"type": "object", "properties": {}, "required": ["a"]},
    ):
        with pytest.raises(InvalidRequestError) as info:
            tool_constraint(request(Family.QWEN_XML, {"f": parameters}), None)
        assert info.value.param == "tools"
