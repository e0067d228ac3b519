"""A chat answer's text as OpenAI's message: ``reasoning_content`` (``reasoning.py``), ``content`` and
``tool_calls`` (``tool_parser.py``), whole (:func:`chat_message`) or as stream deltas
(:class:`ChoiceDeltas`). Both run the same :class:`ChoiceText` over the text, so a stream's deltas
reassemble to the JSON answer (call ids aside: each answer draws its own).

Where a family's markers are special tokens of the model (LFM2's ``<|tool_call_start|>``), the engine's
text leaves them out; the text is then decoded again from the tokens with the markers kept
(:class:`MarkedText`). Requests with ``stop`` strings keep the engine's text (a stop string cuts it).

``finish_reason`` is ``"tool_calls"`` when the answer has calls and the model stopped by itself; an
answer cut by ``max_tokens`` keeps ``"length"``.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from rsmem.engine import CompletionOutput, TextTokenizer
from rsmem.engine.tokenizer import IncrementalDetokenizer
from rsmem.server.reasoning import ReasoningSplitter
from rsmem.server.tool_parser import CallParser, Event, ParsedCall
from rsmem.server.tools import ToolRequest

Json = dict[str, Any]


@dataclass(frozen=True, slots=True)
class ChatShape:
    """What shapes a chat request's answers: the thinking (None when the template does not think,
    else whether the prompt leaves the model thinking), the tools whose calls are parsed, and the
    markers that are special tokens of the model (token id -> text; see :class:`MarkedText`)."""

    thinking: bool | None = None
    tools: ToolRequest | None = None
    markers: dict[int, str] = field(default_factory=dict)
    tokenizer: TextTokenizer | None = None

    @property
    def plain(self) -> bool:
        """The text is the content as it is (no reasoning to split off, no calls to parse)."""
        return self.thinking is None and self.tools is None

    def reader(self) -> ChoiceText:
        return ChoiceText(self)


def special_markers(tokenizer: TextTokenizer | None, texts: Sequence[str]) -> dict[int, str]:
    """The ``texts`` that are one special token of the tokenizer (token id -> text): the engine's text
    leaves special tokens out, so the answer's text is decoded again with them kept."""
    find = getattr(tokenizer.tokenizer, "token_to_id", None) if tokenizer is not None else None
    out = {}
    for text in texts:
        token = find(text) if find is not None else None
        if isinstance(token, int) and tokenizer is not None and tokenizer.decode([token]) == "":
            out[token] = text
    return out


class MarkedText:
    """A choice's text decoded from its tokens with the marker tokens kept (written as their text)."""

    def __init__(self, tokenizer: TextTokenizer, markers: dict[int, str]) -> None:
        self.tokenizer, self.markers = tokenizer, markers
        self.detok = IncrementalDetokenizer(tokenizer)

    def push(self, tokens: Sequence[int]) -> str:
        out = []
        for token in tokens:
            if token in self.markers:
                out += [self.detok.flush(), self.markers[token]]
                self.detok = IncrementalDetokenizer(self.tokenizer)
            else:
                out.append(self.detok.push(token))
        return "".join(out)

    def flush(self) -> str:
        return self.detok.flush()


class ChoiceText:
    """One choice's text as ``("reasoning" | "content", str)`` and ``("call", ParsedCall)`` events."""

    def __init__(self, shape: ChatShape) -> None:
        self.splitter = ReasoningSplitter(shape.thinking) if shape.thinking is not None else None
        tools = shape.tools
        self.calls = CallParser(tools.family, tools.parallel, tools.functions) if tools is not None else None

    def push(self, text: str) -> list[Event]:
        return self._route(self.splitter.push(text) if self.splitter else [("content", text)])

    def finish(self) -> list[Event]:
        events = self._route(self.splitter.finish()) if self.splitter else []
        return events + (self.calls.finish() if self.calls else [])

    def _route(self, parts: list[tuple[str, str]]) -> list[Event]:
        out: list[Event] = []
        for kind, text in parts:
            if kind == "content" and self.calls is not None:
                out += self.calls.push(text)
            elif text:
                out.append((kind, text))
        return out


def new_call_id() -> str:
    return f"call_{secrets.token_hex(12)}"


def tool_call_json(call: ParsedCall, call_id: str) -> Json:
    return {"id": call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


def chat_finish_reason(c: CompletionOutput, has_calls: bool) -> str | None:
    if c.finish_reason is None:
        return None
    reason = c.finish_reason.value
    return "tool_calls" if has_calls and reason == "stop" else reason


def chat_message(shape: ChatShape, c: CompletionOutput) -> tuple[Json, str | None]:
    """The ``message`` of a finished choice and its ``finish_reason``."""
    if shape.plain:
        return {"role": "assistant", "content": c.text}, chat_finish_reason(c, False)
    reader = shape.reader()
    text = c.text
    if shape.markers and shape.tokenizer is not None:
        marked = MarkedText(shape.tokenizer, shape.markers)
        text = marked.push(c.token_ids) + marked.flush()
    events = reader.push(text) + reader.finish()
    content = "".join(str(v) for k, v in events if k == "content")
    reasoning = "".join(str(v) for k, v in events if k == "reasoning")
    calls = [tool_call_json(v, new_call_id()) for k, v in events if isinstance(v, ParsedCall)]
    message: Json = {"role": "assistant", "content": content or None}
    if shape.thinking is not None:
        message["reasoning_content"] = reasoning or None
    if calls:
        message["tool_calls"] = calls
    return message, chat_finish_reason(c, bool(calls))


@dataclass(slots=True)
class ChoiceDeltas:
    """The stream deltas of one choice, report by report."""

    shape: ChatShape
    reader: ChoiceText | None = None
    marked: MarkedText | None = None
    calls: int = 0

    def __post_init__(self) -> None:
        if not self.shape.plain:
            self.reader = self.shape.reader()
        if self.shape.markers and self.shape.tokenizer is not None:
            self.marked = MarkedText(self.shape.tokenizer, self.shape.markers)

    def deltas(self, c: CompletionOutput) -> tuple[list[Json], str | None]:
        """The deltas of a report's new text (several when it completes calls: each call's first delta
        has its id, type, name and empty arguments; the next, its arguments) and the finish reason."""
        if self.reader is None:
            return ([{"content": c.delta_text}] if c.delta_text else []), chat_finish_reason(c, False)
        new = c.delta_text
        if self.marked is not None:
            new = self.marked.push(c.delta_token_ids)
            new += self.marked.flush() if c.finish_reason is not None else ""
        events = self.reader.push(new) if new else []
        if c.finish_reason is not None:
            events += self.reader.finish()
        out: list[Json] = []
        text: Json | None = None  # the text delta being written (content and reasoning between calls)
        for kind, value in events:
            if isinstance(value, ParsedCall):
                call = tool_call_json(value, new_call_id()) | {"index": self.calls}
                call["function"] = {"name": value.name, "arguments": ""}
                out.append({"tool_calls": [call]})
                arguments = {"index": self.calls, "function": {"arguments": value.arguments}}
                out.append({"tool_calls": [arguments]})
                self.calls += 1
                text = None
                continue
            key = "reasoning_content" if kind == "reasoning" else "content"
            if text is None or (key == "reasoning_content" and "content" in text):
                text = {}
                out.append(text)
            text[key] = text.get(key, "") + str(value)
        return out, chat_finish_reason(c, self.calls > 0)


@dataclass(slots=True)
class ChatDeltas:
    """Every choice's :class:`ChoiceDeltas` of one stream."""

    shape: ChatShape = field(default_factory=ChatShape)
    choices: dict[int, ChoiceDeltas] = field(default_factory=dict)

    def of(self, index: int) -> ChoiceDeltas:
        if index not in self.choices:
            self.choices[index] = ChoiceDeltas(self.shape)
        return self.choices[index]
