"""OpenAI's endpoints: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``."""

from __future__ import annotations

import bisect
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from rsmem.engine import RequestOutput, SamplingParams
from rsmem.errors import InvalidRequestError
from rsmem.server.chat_output import ChatDeltas, ChatShape, chat_message, special_markers
from rsmem.server.errors import SERVER, ApiError, invalid_request
from rsmem.server.params import Prompt, check_model, completion_prompts, sampling_params, slot_of
from rsmem.server.reasoning import after_thinking, thinking_started
from rsmem.server.responses import (
    ChatChunks,
    CompletionChunks,
    Envelope,
    chat_logprobs,
    completion_logprobs,
    finish_reason,
    usage,
)
from rsmem.server.runner import EngineStoppedError, QueueFullError, Submission
from rsmem.server.schemas import ChatRequest, CompletionRequest
from rsmem.server.state import AppState, app_state
from rsmem.server.streaming import collect, stream_events
from rsmem.server.tool_grammar import tool_constraint
from rsmem.server.tool_parser import MARKERS
from rsmem.server.tools import template_messages, tool_request

router = APIRouter()


async def submit(
    state: AppState,
    prompts: list[Prompt],
    params: SamplingParams,
    slot: int | None,
    id_prefix: str,
    boundaries: Sequence[int] = (),
) -> Submission:
    """Hand the prompts to the engine together (all or none); its refusals become 400/503 answers."""
    try:
        return await state.runner.submit(
            prompts, params, slot=slot, id_prefix=id_prefix, boundaries=boundaries
        )
    except QueueFullError as exc:
        raise ApiError(
            503,
            f"server busy: {exc}; retry later",
            kind=SERVER,
            code="queue_full",
            headers={"Retry-After": "1"},
        ) from exc
    except InvalidRequestError as exc:
        raise invalid_request(exc) from exc
    except EngineStoppedError as exc:
        raise ApiError(503, str(exc), kind=SERVER, code="engine_stopped") from exc


def event_stream(
    state: AppState, sub: Submission, fmt: CompletionChunks | ChatChunks, usage_: bool
) -> Response:
    events = stream_events(state.runner, sub, fmt, include_usage=usage_)
    return StreamingResponse(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def include_usage(body: CompletionRequest | ChatRequest) -> bool:
    return body.stream_options is not None and body.stream_options.include_usage


@router.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = app_state(request)
    model = {
        "id": state.settings.model_name,
        "object": "model",
        "created": int(state.started),
        "owned_by": "rsmem",
    }
    return {"object": "list", "data": [model]}


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    state = app_state(request)
    check_model(body, state.settings)
    prompts = completion_prompts(body)
    params = sampling_params(body, body.max_tokens)
    sub = await submit(state, prompts, params, slot_of(body), "cmpl")
    env = Envelope(sub.request_ids[0], int(time.time()), state.settings.model_name, sub.request_ids, body.n)
    echoes = [echo_text(state, prompt) if body.echo else "" for prompt in prompts]
    if body.stream:
        by_choice = {k * body.n + i: echo for k, echo in enumerate(echoes) for i in range(body.n)}
        fmt = CompletionChunks(env, state.token_text, include_usage(body), echoes=by_choice)
        return event_stream(state, sub, fmt, include_usage(body))
    outs = await collect(request, state.runner, sub)
    choices = []
    for echo, out in zip(echoes, outs, strict=True):
        for c in out.outputs:
            choice = {
                "index": env.index(out.request_id, c),
                "text": echo + c.text,
                "logprobs": completion_logprobs(c.logprobs, state.token_text, len(echo)),
                "finish_reason": finish_reason(c),
            }
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            choices.append(choice)
    return JSONResponse(env.wrap("text_completion", choices, usage=usage(outs)))


def echo_text(state: AppState, prompt: Prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return state.tokenizer.decode(prompt) if state.tokenizer is not None else ""


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatRequest, request: Request) -> Response:
    state = app_state(request)
    check_model(body, state.settings)
    template = state.settings.chat_template
    try:
        tools = tool_request(body, template)
        messages, tool_list = template_messages(body, template, tools)
    except InvalidRequestError as exc:
        raise invalid_request(exc) from exc
    try:
        prompt = template.render(messages, tools=tool_list)
        prefixes = template.message_prefixes(messages, tool_list)
    except Exception as exc:  # a model's own Jinja template may refuse a conversation
        raise ApiError(400, f"the chat template failed: {exc}", param="messages") from exc
    thinking = thinking_started(prompt, prefixes[-1] if prefixes else None) if template.thinks else None
    texts = MARKERS.get(tools.family, ()) if tools is not None else ()
    markers = special_markers(state.tokenizer, texts) if not body.stop else {}
    shape = ChatShape(thinking, tools, markers, state.tokenizer)
    max_tokens = body.max_completion_tokens or body.max_tokens or state.settings.chat_max_tokens
    forced = tools is not None and tools.forced  # the grammar ends the answer: no template stop
    params = chat_params(sampling_params(body, max_tokens, () if forced else template.stop), shape)
    tokens, boundaries = message_boundaries(state, prompt, prefixes)
    sub = await submit(state, [tokens], params, slot_of(body), "chatcmpl", boundaries)
    env = Envelope(sub.request_ids[0], int(time.time()), state.settings.model_name, sub.request_ids, body.n)
    if body.stream:
        fmt = ChatChunks(env, state.token_text, include_usage(body), deltas=ChatDeltas(shape))
        return event_stream(state, sub, fmt, include_usage(body))
    outs = await collect(request, state.runner, sub)
    return JSONResponse(env.wrap("chat.completion", chat_choices(state, outs[0], shape), usage=usage(outs)))


def message_boundaries(
    state: AppState, prompt: str, prefixes: list[str]
) -> tuple[str | list[int], list[int]]:
    """The prompt's tokens and, for the prefix cache, where each message ends in them: the tokens that
    end within the rendered prefix (a token merged across the boundary moves it back, never past it).
    One encoding of the prompt serves every prefix; a prefix that is not the prompt's start (a template
    rendering partial conversations differently) is encoded and compared. Without a tokenizer the text
    goes as it is, with no boundaries."""
    tok = state.tokenizer
    if tok is None:
        return prompt, []
    tokens, ends = tok.encode_with_ends(prompt)
    if not tokens:
        return prompt, []
    boundaries = []
    for text in prefixes:
        if prompt.startswith(text):
            boundaries.append(bisect.bisect_right(ends, len(text)))
            continue
        part = tok.encode(text)
        n, limit = 0, min(len(part), len(tokens))
        while n < limit and part[n] == tokens[n]:
            n += 1
        boundaries.append(n)
    return tokens, boundaries


def chat_choices(state: AppState, out: RequestOutput, shape: ChatShape) -> list[dict[str, Any]]:
    choices = []
    for c in out.outputs:
        message, reason = chat_message(shape, c)
        logprobs = chat_logprobs(c.logprobs, state.token_text)
        choices.append({"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": reason})
    return choices


def chat_params(params: SamplingParams, shape: ChatShape) -> SamplingParams:
    """The sampling parameters with the constraint of a forced call (``tool_choice`` required or named);
    for a template that thinks, the request's constraint applies from the end of the thinking."""
    if shape.tools is None or not shape.tools.forced:
        if params.constraint is None or shape.thinking is None:
            return params
        try:
            return dataclasses.replace(params, constraint=after_thinking(params.constraint, shape.thinking))
        except InvalidRequestError as exc:
            raise invalid_request(exc) from exc
    if params.constraint is not None:
        message = f"tool_choice {shape.tools.choice!r} cannot be combined with another constraint"
        raise ApiError(400, message, param="tool_choice")
    try:
        constraint = tool_constraint(shape.tools, shape.thinking, shape.markers)
        return dataclasses.replace(params, constraint=constraint)
    except InvalidRequestError as exc:  # a stop string: it could cut the call short
        raise invalid_request(exc) from exc
