"""OpenAI's response shapes: choices, log-probabilities, usage, and the chunks of a stream."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from rsmem.engine import CompletionOutput, FinishReason, RequestOutput, TokenLogprobs
from rsmem.server.chat_output import ChatDeltas
from rsmem.server.errors import SERVER, ApiError, failed_generation
from rsmem.server.runner import Report, StepFailure

TokenText = Callable[[int], str]
Json = dict[str, Any]


def failure_of(report: Report) -> ApiError | None:
    """The error answer for a report that failed (a completion finished with "error", or the engine
    step raised); None for a report that did not."""
    if isinstance(report, StepFailure):
        return ApiError(500, report.message, kind=SERVER, code="engine_failure")
    for c in report.outputs:
        if c.finish_reason is FinishReason.ERROR:
            message = c.error or report.error or "the generation failed"
            return failed_generation(message, report.error_kind)
    return None


def finish_reason(c: CompletionOutput) -> str | None:
    return c.finish_reason.value if c.finish_reason is not None else None


def new_logprobs(c: CompletionOutput) -> tuple[TokenLogprobs, ...] | None:
    """The log-probs of this report's new tokens (``logprobs`` aligns with ``token_ids``)."""
    if c.logprobs is None:
        return None
    return c.logprobs[len(c.token_ids) - len(c.delta_token_ids) :]


def completion_logprobs(
    lps: Sequence[TokenLogprobs] | None, token_text: TokenText, offset: int = 0
) -> Json | None:
    """The completions endpoint's format; ``text_offset`` counts from ``offset``."""
    if lps is None:
        return None
    offsets, tokens = [], []
    for lp in lps:
        offsets.append(offset)
        tokens.append(token_text(lp.token))
        offset += len(tokens[-1])
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{token_text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


def chat_logprobs(lps: Sequence[TokenLogprobs] | None, token_text: TokenText) -> Json | None:
    """The chat endpoint's format: ``{"content": [{token, logprob, bytes, top_logprobs}, ...]}``."""
    if lps is None:
        return None

    def entry(token: int, logprob: float) -> Json:
        s = token_text(token)
        return {"token": s, "logprob": logprob, "bytes": list(s.encode())}

    return {
        "content": [
            entry(lp.token, lp.logprob) | {"top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ]
    }


def usage(outs: Sequence[RequestOutput]) -> Json:
    """Token counts of a response; ``cached_tokens`` are prompt tokens the prompt cache served."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
        "prompt_tokens_details": {"cached_tokens": sum(o.num_cached_tokens for o in outs)},
    }


@dataclass(slots=True)
class Envelope:
    """What every response of one HTTP request shares: its id, time, model, and the choice numbering
    (prompt ``k``'s completion ``i`` is choice ``k * n + i``)."""

    id: str
    created: int
    model: str
    request_ids: tuple[str, ...]
    n: int

    def index(self, request_id: str, c: CompletionOutput) -> int:
        return self.request_ids.index(request_id) * self.n + c.index

    def wrap(self, obj: str, choices: list[Json], **extra: Any) -> Json:
        return {
            "id": self.id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        } | extra


def changed_choices(
    env: Envelope, out: RequestOutput
) -> Iterator[tuple[CompletionOutput, int, tuple[TokenLogprobs, ...] | None]]:
    """The choices of a report with something to stream (new text, new log-probs or a finish reason):
    each with its index in the response and its new log-probs."""
    for c in out.outputs:
        lps = new_logprobs(c)
        if c.delta_text or c.finish_reason is not None or lps:
            yield c, env.index(out.request_id, c), lps


@dataclass(slots=True)
class CompletionChunks:
    """``text_completion`` chunks: one per choice with new text, tokens (when log-probs are asked) or
    a finish reason. With ``echo`` (``echoes``: choice -> its prompt's text), each choice's prompt comes
    first, in a chunk of its own sent before any token, and ``text_offset`` counts from its start (as in
    the JSON answer, whose text is the prompt followed by the completion)."""

    env: Envelope
    token_text: TokenText
    with_usage: bool = False
    echoes: dict[int, str] = field(default_factory=dict)
    offsets: dict[int, int] = field(default_factory=dict)  # choice -> text_offset of its next token

    def opening(self) -> list[Json]:
        """The echoed prompts, one chunk per choice, in choice order."""
        result = []
        for index, text in sorted(self.echoes.items()):
            if text:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": None}
                result.append(self.env.wrap("text_completion", [choice], **self._usage_field()))
        return result

    def chunks(self, out: RequestOutput) -> list[Json]:
        result = []
        for c, index, lps in changed_choices(self.env, out):
            start = self.offsets.get(index, len(self.echoes.get(index, "")))
            logprobs = completion_logprobs(lps, self.token_text, start)
            if logprobs is not None and logprobs["text_offset"]:
                self.offsets[index] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
            choice = {
                "index": index,
                "text": c.delta_text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(c),
            }
            result.append(self.env.wrap("text_completion", [choice], **self._usage_field()))
        return result

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> Json:
        return self.env.wrap("text_completion", [], usage=usage(outs))

    def _usage_field(self) -> Json:
        return {"usage": None} if self.with_usage else {}


@dataclass(slots=True)
class ChatChunks:
    """``chat.completion.chunk`` chunks: the first of each choice carries ``role``. With reasoning or
    tools (``deltas``' shape) a report's text may give several deltas (reasoning, content, each call's
    name then arguments) or none yet (text held back): the log-probs ride on the first chunk, the
    finish reason on the last."""

    env: Envelope
    token_text: TokenText
    with_usage: bool = False
    started: set[int] = field(default_factory=set)
    deltas: ChatDeltas = field(default_factory=ChatDeltas)

    def opening(self) -> list[Json]:
        """Nothing before the first token (its chunk carries the role)."""
        return []

    def chunks(self, out: RequestOutput) -> list[Json]:
        result = []
        for c, index, lps in changed_choices(self.env, out):
            deltas, reason = self.deltas.of(index).deltas(c)
            logprobs = chat_logprobs(lps, self.token_text)
            if not deltas:
                if reason is None and logprobs is None:
                    continue  # text held back until it is known
                deltas = [{}]
            if index not in self.started:
                self.started.add(index)
                deltas[0] = {"role": "assistant"} | deltas[0]
            extra = {"usage": None} if self.with_usage else {}
            for k, delta in enumerate(deltas):
                choice = {
                    "index": index,
                    "delta": delta,
                    "logprobs": logprobs if k == 0 else None,
                    "finish_reason": reason if k == len(deltas) - 1 else None,
                }
                result.append(self.env.wrap("chat.completion.chunk", [choice], **extra))
        return result

    def usage_chunk(self, outs: Sequence[RequestOutput]) -> Json:
        return self.env.wrap("chat.completion.chunk", [], usage=usage(outs))
