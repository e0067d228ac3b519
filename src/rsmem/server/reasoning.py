"""Reasoning: the thinking of a model whose template thinks (``<think>`` ... ``</think>``, e.g. Qwen3 and
Qwen3.5) goes to ``reasoning_content``, the rest to ``content``.

The answer is thinking from its start when the generation prompt opened a ``<think>`` it did not close
(:func:`thinking_started`), or when the answer itself starts, after white space, with ``<think>``.
The thinking ends at the first ``</think>``; newlines at its start and end are dropped, as are the
newlines that follow ``</think>`` (what Qwen's templates drop when they render an earlier turn).
An answer that ends while thinking is all reasoning. As with the calls, :class:`ReasoningSplitter`
gives the same split whether the text comes whole or in pieces: text that may be the start of
``<think>`` or ``</think>`` is held back until it is known.

A constraint (a forced call, a response format) applies from the end of the thinking: its grammar is
nested in one that lets the model think first (:func:`thinking_first`, :func:`after_thinking`).
"""

from __future__ import annotations

import json

from rsmem.engine.constraints import Constraint, grammar_text
from rsmem.server.tool_parser import held_prefix

OPEN, CLOSE = "<think>", "</think>"
# Lark: text up to and with the first </think> (one lexeme, so it cannot run past it)
REASONING = r"REASONING: /(?s:.*)<\/think>/ & ~/(?s:.*<\/think>.+)/"


def thinking_started(prompt: str, history: str | None) -> bool:
    """Whether the generation prompt (``prompt`` past the rendered ``history``, when it starts with it)
    leaves the model inside ``<think>``."""
    tail = prompt[len(history) :] if history is not None and prompt.startswith(history) else prompt
    return tail.rfind(OPEN) > tail.rfind(CLOSE)


class ReasoningSplitter:
    """Splits one choice's text into ``("reasoning", text)`` and ``("content", text)`` events."""

    def __init__(self, started: bool) -> None:
        self.state = "lead" if started else "start"
        self.buf = ""

    def push(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while True:
            if self.state == "start":
                head = self.buf.lstrip()
                if len(head) < len(OPEN) and OPEN.startswith(head):
                    return out  # blank so far, or the start of "<think>"
                if head.startswith(OPEN):
                    self.buf, self.state = head[len(OPEN) :], "lead"
                else:
                    self.state = "content"
            elif self.state in ("lead", "after"):  # newlines after <think> / after </think>
                self.buf = self.buf.lstrip("\n")
                if not self.buf:
                    return out
                self.state = "think" if self.state == "lead" else "content"
            elif self.state == "think":
                i = self.buf.find(CLOSE)
                if i >= 0:
                    _emit(out, "reasoning", self.buf[:i].rstrip("\n"))
                    self.buf, self.state = self.buf[i + len(CLOSE) :], "after"
                    continue
                keep = held_prefix(self.buf, CLOSE)
                head = self.buf[: len(self.buf) - keep]
                said = head.rstrip("\n")  # newlines may be the last before </think>: held
                _emit(out, "reasoning", said)
                self.buf = self.buf[len(said) :]
                return out
            else:
                _emit(out, "content", self.buf)
                self.buf = ""
                return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.state in ("start", "content"):
            _emit(out, "content", self.buf)
        elif self.state == "think":
            _emit(out, "reasoning", self.buf.rstrip("\n"))
        self.buf = ""
        return out


def _emit(out: list[tuple[str, str]], kind: str, text: str) -> None:
    if text:
        out.append((kind, text))


def thinking_first(started: bool, answer: str) -> str:
    """The ``start`` rule of a Lark grammar that lets the model think, then derives ``answer`` (an
    expression of the grammar): free text up to the first ``</think>`` when the prompt opened the
    thinking, else an optional ``<think>`` ... ``</think>``; then the newlines the model writes."""
    if started:
        return f"start: REASONING /\\n*/ {answer}\n{REASONING}\n"
    return f'start: ("<think>" REASONING /\\n*/)? {answer}\n{REASONING}\n'


def after_thinking(constraint: Constraint, started: bool) -> Constraint:
    """``constraint`` applied from the end of the thinking (a response format of a thinking model):
    the same grammar, nested in one that lets the model think first; refusals still name its field."""
    text = grammar_text(constraint)
    if text.lstrip().startswith("{"):  # llguidance's JSON form: one grammar, a schema or Lark text
        (grammar,) = json.loads(text)["grammars"]
        if grammar.get("json_schema") is not None:
            answer = f"answer: %json {json.dumps(grammar['json_schema'], ensure_ascii=False)}"
            return Constraint.lark(thinking_first(started, "answer") + answer + "\n", field=constraint.field)
        text = grammar["lark_grammar"]
    inner = "\n".join(line for line in text.splitlines() if not line.startswith("%llguidance"))
    answer = f"answer: %lark {{\n{inner}\n}}"
    return Constraint.lark(thinking_first(started, "answer") + answer + "\n", field=constraint.field)
