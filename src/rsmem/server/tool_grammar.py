"""The constraint of a forced call (``tool_choice`` ``required`` or a named function): an llguidance Lark
grammar of the family's call syntax whose arguments are ``%json`` of the function's ``parameters``, so
every answer is a call (or, with ``parallel_tool_calls``, calls) the parser of ``tool_parser.py`` reads
and whose arguments validate against the schema.

- ``hermes``: ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``, calls one per line.
- ``lfm2``: ``<|tool_call_start|>[{"name": "f", "arguments": {...}}, ...]<|tool_call_end|>``, the JSON
  form of LFM2's calls (Python literals cannot carry every JSON value exactly).
- ``generic``: ``{"tool_call": {"name": "f", "arguments": {...}}}`` or ``{"tool_calls": [...]}``.

The arguments are compact JSON with ``", "`` and ``": "`` separators (as ``json.dumps`` writes them).
A marker that is a special token of the model is that token in the grammar (``<[id]>``), as the model
was trained to write it; otherwise its text.
For a template that thinks, the grammar first lets the model think: free text up to the first
``</think>`` (from the answer's start when the prompt opened ``<think>``, else after an optional
``<think>``), then the newlines it writes; the calls follow.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from rsmem.engine.constraints import Constraint
from rsmem.errors import InvalidRequestError
from rsmem.server.reasoning import thinking_first
from rsmem.server.tool_parser import MARKERS
from rsmem.server.tools import Family, ToolRequest

JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": False}


def tool_grammar(tools: ToolRequest, thinking: bool | None, special: Mapping[int, str] | None = None) -> str:
    """The Lark grammar of a forced call (see the module docstring). A marker that is a special token
    of the model (``special``: token id -> text) is that token, as the model writes it."""
    ids = {text: token for token, text in (special or {}).items()}

    def marker(text: str) -> str:
        return f"<[{ids[text]}]>" if text in ids else _lit(text)

    names = [tools.name] if tools.name is not None else list(tools.functions)
    rules = [f"call: {' | '.join(f'call{i}' for i in range(len(names)))}"]
    for i, name in enumerate(names):
        if tools.family is Family.QWEN_XML:
            rules += _xml_rules(i, name, tools.functions[name])
            continue
        head = _lit(f'{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": ')
        rules.append(f'call{i}: {head} args{i} "}}"')
        rules.append(f"args{i}: %json {json.dumps(_styled(tools.functions[name]), ensure_ascii=False)}")
    if tools.family in MARKERS:
        start, end = (marker(m) for m in MARKERS[tools.family])
    if tools.family in (Family.HERMES, Family.QWEN_XML):
        rules.append(f'block: {start} "\\n" call "\\n" {end}')
        calls = 'block ("\\n" block)*' if tools.parallel else "block"
    elif tools.family is Family.LFM2:
        items = 'call (", " call)*' if tools.parallel else "call"
        calls = f'{start} "[" {items} "]" {end}'
    elif tools.parallel:
        calls = '"{\\"tool_calls\\": [" call (", " call)* "]}"'
    else:
        calls = '"{\\"tool_call\\": " call "}"'
    if tools.family is Family.QWEN_XML:
        rules.append(XML_TEXT)
    head = f"start: {calls}\n" if thinking is None else thinking_first(thinking, calls)
    return head + "\n".join(rules) + "\n"


def tool_constraint(
    tools: ToolRequest, thinking: bool | None, special: Mapping[int, str] | None = None
) -> Constraint:
    """The constraint of a forced call; the engine refuses (400 naming ``tools``) a schema it cannot
    enforce when it compiles it."""
    return Constraint.lark(tool_grammar(tools, thinking, special), field="tools")


# Qwen's XML: a string parameter's text, up to the first </parameter> (one lexeme: it cannot run past it)
XML_TEXT = r"XML_TEXT: /(?s:.*)\n<\/parameter>\n/ & ~/(?s:.*<\/parameter>..+)/"
XML_OBJECT_KEYS = {
    "type",
    "properties",
    "required",
    "additionalProperties",
    "description",
    "title",
    "$schema",
}
XML_STRING_KEYS = {"type", "description", "title", "enum", "examples", "default"}


def _xml_rules(i: int, name: str, schema: dict[str, Any]) -> list[str]:
    """Qwen's XML call of function ``name``: its parameters in the schema's order, the required ones
    always; a string's value as text (or one of its ``enum``), any other as JSON of its schema.
    InvalidRequestError naming ``tools`` for a schema this form cannot enforce exactly."""

    def refuse(why: str) -> InvalidRequestError:
        return InvalidRequestError(
            "tools", f"function {name!r}: {why}, which Qwen's XML calls cannot enforce"
        )

    extra = set(schema) - XML_OBJECT_KEYS
    if extra:
        raise refuse(f"its parameters use {', '.join(sorted(extra))}")
    properties = schema.get("properties") or {}
    required = schema.get("required") or []
    if not isinstance(properties, dict) or any(k not in properties for k in required):
        raise refuse("a required parameter is not among its properties")
    parts = []
    for k, (key, sub) in enumerate(properties.items()):
        head = _lit(f"<parameter={key}>\n")
        if sub is True:
            sub = {}
        if not isinstance(sub, dict):
            raise refuse(f"parameter {key!r} accepts no value")
        if sub.get("type") == "string":
            if set(sub) - XML_STRING_KEYS:
                raise refuse(f"parameter {key!r} uses {', '.join(sorted(set(sub) - XML_STRING_KEYS))}")
            if "enum" in sub:
                if not sub["enum"] or not all(isinstance(v, str) for v in sub["enum"]):
                    raise refuse(f"parameter {key!r} has an enum that is not strings")
                value = "(" + " | ".join(_lit(v) for v in sub["enum"]) + ') "\\n</parameter>\\n"'
            else:
                value = "XML_TEXT"
        else:
            value = f'v{i}_{k} "\\n</parameter>\\n"'
            parts_json = json.dumps(_styled(sub), ensure_ascii=False)
            parts.append(f"v{i}_{k}: %json {parts_json}")
        parts.append(f"p{i}_{k}: {head} {value}")
    params = " ".join(f"p{i}_{k}" + ("" if key in required else "?") for k, key in enumerate(properties))
    function = _lit(f"<function={name}>\n")
    return [f'call{i}: {function} {params} "</function>"', *parts]


def _styled(schema: dict[str, Any]) -> dict[str, Any]:
    user = schema.get("x-guidance")
    return {**schema, "x-guidance": {**(user if isinstance(user, dict) else {}), **JSON_STYLE}}


def _lit(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text, ensure_ascii=False)
