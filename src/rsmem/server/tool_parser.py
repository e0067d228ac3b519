"""The model's calls, read out of its text as it comes (:class:`CallParser`), for each family of
``tools.py``.

One parser serves both answers: a JSON answer pushes the whole text and finishes, a stream pushes each
delta; the parser's output does not depend on where the text was cut, so the streamed deltas
reassemble to the JSON answer. Rules:

- ``hermes`` / ``qwen_xml`` / ``lfm2``: text outside the family's markers is content. Text that may be
  the start of a marker is held back until it is known. A block between the markers is a call
  (Hermes: one JSON object with ``name`` and ``arguments``; Qwen's XML: ``<function=name>`` and its
  ``<parameter=key>`` values; LFM2: a list of ``name(key=value, ...)`` Python calls, or of Hermes'
  JSON objects) when it parses; otherwise its text, markers included, stays content, as does a block
  the text ends inside. Without ``parallel_tool_calls`` the first call ends the parsing: a block of
  several calls is content, and so is everything after the first call.
- ``generic``: an answer that starts (after white space) with ``{`` is held until the end and read as
  one JSON object: ``{"tool_call": {...}}`` or ``{"tool_calls": [...]}`` are calls, ``{"response": x}``
  is the content ``x``; anything else is content as written.
- Content that is only white space is held until some other text follows it; an answer whose content
  is only white space has none (``null``).
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rsmem.server.tools import Family

MARKERS = {
    Family.HERMES: ("<tool_call>", "</tool_call>"),
    Family.QWEN_XML: ("<tool_call>", "</tool_call>"),
    Family.LFM2: ("<|tool_call_start|>", "<|tool_call_end|>"),
}


@dataclass(frozen=True, slots=True)
class ParsedCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's ``function.arguments``


Json = dict[str, Any]
Event = tuple[str, "str | ParsedCall"]  # ("content", text) or ("call", ParsedCall)


def held_prefix(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (text held back for it)."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class CallParser:
    """Content and calls of one choice's text; ``push`` each piece, then ``finish`` once."""

    def __init__(
        self, family: Family, parallel: bool = True, functions: Mapping[str, Json] | None = None
    ) -> None:
        self.family = family
        self.parallel = parallel
        self.functions = functions or {}  # name -> parameters schema (qwen_xml reads values by type)
        self.buf = ""
        self.in_call = False
        self.calls = 0
        self.generic_json: bool | None = None  # generic: None until the first non-blank character
        self._held_blank = ""
        self._content_seen = False

    def push(self, text: str) -> list[Event]:
        self.buf += text
        out: list[Event] = []
        if self.family is Family.GENERIC:
            self._push_generic(out)
        else:
            self._push_marked(out)
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self.family is Family.GENERIC:
            if self.generic_json:
                self._finish_generic(out)
            else:
                self._content(out, self.buf)
        else:
            start = MARKERS[self.family][0]
            self._content(out, (start if self.in_call else "") + self.buf)
        self.buf = ""
        return out

    # ---- hermes / lfm2 --------------------------------------------------------------------------

    def _push_marked(self, out: list[Event]) -> None:
        start, end = MARKERS[self.family]
        while True:
            if not self.in_call:
                if self.calls and not self.parallel:
                    self._content(out, self.buf)
                    self.buf = ""
                    return
                i = self.buf.find(start)
                if i < 0:
                    keep = held_prefix(self.buf, start)
                    self._content(out, self.buf[: len(self.buf) - keep])
                    self.buf = self.buf[len(self.buf) - keep :]
                    return
                self._content(out, self.buf[:i])
                self.buf, self.in_call = self.buf[i + len(start) :], True
            j = self.buf.find(end)
            if j < 0:
                return
            body, self.buf, self.in_call = self.buf[:j], self.buf[j + len(end) :], False
            calls = parse_block(self.family, body, self.functions)
            if calls is None or (not self.parallel and len(calls) > 1):
                self._content(out, start + body + end)
                continue
            self.calls += len(calls)
            out += [("call", c) for c in calls]

    # ---- generic --------------------------------------------------------------------------------

    def _push_generic(self, out: list[Event]) -> None:
        if self.generic_json is None:
            head = self.buf.lstrip()
            if not head:
                return
            self.generic_json = head.startswith("{")
        if not self.generic_json:
            self._content(out, self.buf)
            self.buf = ""

    def _finish_generic(self, out: list[Event]) -> None:
        try:
            answer = json.loads(self.buf)
        except json.JSONDecodeError:
            answer = None
        calls = generic_calls(answer, self.parallel) if isinstance(answer, dict) else None
        if calls is not None:
            self.calls += len(calls)
            out += [("call", c) for c in calls]
        elif isinstance(answer, dict) and set(answer) == {"response"}:
            response = answer["response"]
            text = response if isinstance(response, str) else json.dumps(response, ensure_ascii=False)
            self._content(out, text)
        else:
            self._content(out, self.buf)

    # ---- content --------------------------------------------------------------------------------

    def _content(self, out: list[Event], text: str) -> None:
        if not text:
            return
        if not self._content_seen:
            self._held_blank += text
            if not self._held_blank.strip():
                return
            text, self._held_blank, self._content_seen = self._held_blank, "", True
        out.append(("content", text))


def parse_block(
    family: Family, body: str, functions: Mapping[str, Json] | None = None
) -> list[ParsedCall] | None:
    """The calls of the text between a family's markers; None when it is not one."""
    text = body.strip()
    if family is Family.QWEN_XML:
        call = _xml_call(text, functions or {})
        return None if call is None else [call]
    if family is Family.HERMES:
        call = _json_call(_loads(text))
        return None if call is None else [call]
    value = _loads(text)
    if isinstance(value, list) and value:
        calls = [_json_call(v) for v in value]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]
    return _python_calls(text)


def generic_calls(answer: dict[str, Any], parallel: bool) -> list[ParsedCall] | None:
    if set(answer) == {"tool_call"}:
        call = _json_call(answer["tool_call"])
        return None if call is None else [call]
    if set(answer) == {"tool_calls"} and isinstance(answer["tool_calls"], list) and answer["tool_calls"]:
        calls = [_json_call(v) for v in answer["tool_calls"]]
        if any(c is None for c in calls) or (not parallel and len(calls) > 1):
            return None
        return [c for c in calls if c is not None]
    return None


def _loads(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return None


def _json_call(value: Any) -> ParsedCall | None:
    """``{"name": str, "arguments": object or its JSON text}`` (``arguments`` may be left out)."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    if set(value) - {"name", "arguments"}:
        return None
    args = value.get("arguments", {})
    if isinstance(args, str):
        args = _loads(args)
    if not isinstance(args, dict):
        return None
    return ParsedCall(value["name"], json.dumps(args, ensure_ascii=False))


_XML_CALL = re.compile(r"<function=([^>\n]+)>\n?(.*)</function>", re.DOTALL)
_XML_PARAM = re.compile(r"\s*<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _xml_call(text: str, functions: Mapping[str, Json]) -> ParsedCall | None:
    """Qwen's ``<function=name>`` with ``<parameter=key>`` values: a value whose schema is a string is
    taken as written (one newline each side dropped), any other is read as JSON (Python's ``True``,
    ``False`` and ``None`` too), or as text when it is not JSON (as vLLM's qwen3_coder parser does)."""
    match = _XML_CALL.fullmatch(text)
    if match is None:
        return None
    name, rest = match.group(1).strip(), match.group(2)
    properties = functions.get(name, {}).get("properties")
    properties = properties if isinstance(properties, dict) else {}
    args: Json = {}
    pos = 0
    while (param := _XML_PARAM.match(rest, pos)) is not None:
        key, value = param.group(1).strip(), param.group(2)
        schema = properties.get(key)
        if isinstance(schema, dict) and schema.get("type") == "string":
            args[key] = value
        elif value.strip() in _NAMES:
            args[key] = _NAMES[value.strip()]
        else:
            parsed = _loads(value)
            args[key] = value if parsed is None and value.strip() != "null" else parsed
        pos = param.end()
    if rest[pos:].strip():
        return None
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def _python_calls(text: str) -> list[ParsedCall] | None:
    """LFM2's ``[name(key=value, ...), ...]``: keyword arguments with literal values only."""
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not isinstance(node, ast.Call) or node.args:
            return None
        name = _dotted(node.func)
        if name is None:
            return None
        args = {}
        for kw in node.keywords:
            if kw.arg is None:
                return None
            try:
                args[kw.arg] = _literal(kw.value)
            except ValueError:
                return None
        calls.append(ParsedCall(name, json.dumps(args, ensure_ascii=False)))
    return calls


def _dotted(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _literal(node: ast.expr) -> Any:
    """A Python (or JSON) literal as a JSON value; ValueError for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (str, int, float, bool, type(None))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _literal(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        out = {}
        for k, v in zip(node.keys, node.values, strict=True):
            key = _literal(k) if k is not None else None
            if not isinstance(key, str):
                raise ValueError("a dict key that is not a string")
            out[key] = _literal(v)
        return out
    raise ValueError(f"not a literal: {ast.dump(node)}")
