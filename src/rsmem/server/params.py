"""From a request body to what the engine takes: prompts and ``SamplingParams``.

Nothing here checks a value's range: the JSON types are pydantic's job (``schemas.py``), every value
and limit is the engine's (``SamplingParams`` and ``Engine.add_request`` raise
:class:`~rsmem.errors.InvalidRequestError`, which ``errors.invalid_request`` turns into a 400).
"""

from __future__ import annotations

from rsmem.engine import SamplingParams
from rsmem.errors import InvalidRequestError
from rsmem.server.errors import ApiError, invalid_request
from rsmem.server.schemas import ChatRequest, CompletionRequest
from rsmem.server.state import ServerSettings
from rsmem.server.structured import refuse_unimplemented, request_constraint

Body = CompletionRequest | ChatRequest
Prompt = str | list[int]


def check_model(body: Body, settings: ServerSettings) -> None:
    """An unknown ``model`` is a 404 ``model_not_found``, as OpenAI answers it."""
    if not settings.accepts_model(body.model):
        raise ApiError(
            404,
            f"the model {body.model!r} does not exist: this server serves {settings.model_name!r}",
            param="model",
            code="model_not_found",
        )


def sampling_params(body: Body, max_tokens: int | None, extra_stop: tuple[str, ...] = ()) -> SamplingParams:
    """The request's sampling parameters and constraint; a value the engine refuses is a 400 naming the
    JSON field. ``extra_stop`` (a chat template's) is dropped under a constraint, which decides the end."""
    try:
        refuse_unimplemented(body)
        constraint = request_constraint(body)
        return SamplingParams(
            temperature=body.temperature,
            top_p=body.top_p,
            top_k=body.top_k,
            min_p=body.min_p,
            repetition_penalty=body.repeat_penalty,
            presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty,
            logit_bias={int(k): v for k, v in body.logit_bias.items()} if body.logit_bias else None,
            seed=body.seed,
            max_tokens=max_tokens,
            stop=tuple(body.stop or ()) + (extra_stop if constraint is None else ()),
            n=body.n,
            logprobs=logprobs_count(body),
            constraint=constraint,
        )
    except InvalidRequestError as exc:
        raise invalid_request(exc) from exc


def logprobs_count(body: Body) -> int | None:
    """Top alternatives to report per token: completions' ``logprobs``, chat's ``top_logprobs`` (when
    ``logprobs`` is true); None for none."""
    if isinstance(body, ChatRequest):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs


def completion_prompts(body: CompletionRequest) -> list[Prompt]:
    """OpenAI's four prompt forms (text, token ids, a list of either) as a list of prompts."""
    p = body.prompt
    if isinstance(p, str):
        return [p]
    ids = [x for x in p if isinstance(x, int)]
    if len(ids) == len(p):
        return [ids]
    return [x if isinstance(x, str) else list(x) for x in p if not isinstance(x, int)]


def slot_of(body: Body) -> int | None:
    """``id_slot`` (llama.cpp): -1 or absent for any slot; the engine checks that it exists."""
    return None if body.id_slot is None or body.id_slot == -1 else body.id_slot
