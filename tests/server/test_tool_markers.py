"""Call markers that are special tokens of the model (LFM2's ``<|tool_call_start|>``): the engine's text
leaves special tokens out, so the answer is decoded again with them kept, whole and streamed alike, and a
forced call's grammar has the model write the special token itself. The tokenizer here is the embedded
model's with LFM2's markers added as special tokens."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from rsmem.engine import LLM, CompletionOutput, FinishReason, TextTokenizer
from rsmem.engine.constraints import ConstraintCompiler
from rsmem.server.chat_output import ChatShape, ChoiceDeltas, MarkedText, chat_message, special_markers
from rsmem.server.tool_grammar import tool_constraint
from rsmem.server.tool_parser import MARKERS
from rsmem.server.tools import Family, ToolRequest

START, END = MARKERS[Family.LFM2]
SCHEMA = {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}}, "required": ["city"]}


@pytest.fixture(scope="module")
def tok(shared_llm: LLM) -> TextTokenizer:
    assert shared_llm.tokenizer is not None
    inner = Tokenizer.from_str(shared_llm.tokenizer.tokenizer.to_str())
    inner.add_special_tokens([START, END])
    return TextTokenizer(inner, eos_token_id=shared_llm.tokenizer.eos_token_id)


def answer_tokens(tok: TextTokenizer, inside: str, after: str) -> list[int]:
    ids = special_markers(tok, [START, END])
    start, end = sorted(ids)
    return [*tok.encode("Let me see. "), start, *tok.encode(inside), end, *tok.encode(after)]


def test_markers_and_their_text(tok: TextTokenizer):
    ids = special_markers(tok, [START, END, "<tool_call>", "plain"])
    assert sorted(ids.values()) == sorted([START, END])
    tokens = answer_tokens(tok, '[weather(city="Oslo")]', " Done ü.")
    assert START not in tok.decode(tokens)  # what the engine's text holds
    whole = MarkedText(tok, ids)
    text = whole.push(tokens) + whole.flush()
    assert text == f'Let me see. {START}[weather(city="Oslo")]{END} Done ü.'
    pieces = MarkedText(tok, ids)
    assert "".join(pieces.push([t]) for t in tokens) + pieces.flush() == text


def test_whole_and_streamed_answers_read_the_kept_markers(tok: TextTokenizer):
    ids = special_markers(tok, [START, END])
    tools = ToolRequest((), {"weather": SCHEMA}, "auto", None, True, Family.LFM2)
    shape = ChatShape(None, tools, ids, tok)
    tokens = answer_tokens(tok, '[weather(city="Oslo")]', " Done.")
    final = CompletionOutput(0, tok.decode(tokens), tuple(tokens), FinishReason.STOP, None)
    message, reason = chat_message(shape, final)
    assert reason == "tool_calls" and message["content"] == "Let me see.  Done."
    call = message["tool_calls"][0]["function"]
    assert call == {"name": "weather", "arguments": json.dumps({"city": "Oslo"})}
    stream = ChoiceDeltas(shape)
    content, calls = "", []
    for k, token in enumerate(tokens):
        last = k == len(tokens) - 1
        report = CompletionOutput(
            0, "", tuple(tokens[: k + 1]), FinishReason.STOP if last else None, None, "", (token,)
        )
        deltas, _ = stream.deltas(report)
        for d in deltas:
            content += d.get("content", "")
            calls += [c["function"] for c in d.get("tool_calls", ()) if "name" in c["function"]]
    assert content == message["content"] and [c["name"] for c in calls] == ["weather"]


def test_a_forced_call_writes_the_special_tokens(tok: TextTokenizer, shared_llm: LLM):
    ids = special_markers(tok, [START, END])
    start, end = sorted(ids)
    compiler = ConstraintCompiler(tok, shared_llm.context.n_vocab + 2)
    tools = ToolRequest((), {"weather": SCHEMA}, "required", None, False, Family.LFM2)
    inside = tok.encode('[{"name": "weather", "arguments": {"city": "Lima"}}]')

    def accepts(tokens: list[int]) -> bool:
        matcher = compiler.compile(tool_constraint(tools, None, ids)).matcher()
        return all(matcher.llmatcher.consume_token(t) for t in tokens) and matcher.llmatcher.is_accepting()

    assert accepts([start, *inside, end])
    spelled = [t for ch in START for t in tok.encode(ch)]  # the marker written as text
    assert start not in spelled and not accepts([*spelled, *inside, end])
