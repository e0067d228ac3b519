"""Structured-output request fields, and the fields the server refuses rather than ignores.

Every way a client asks for a constraint becomes one :class:`~rsmem.engine.constraints.Constraint`
(:func:`request_constraint`): OpenAI's ``response_format`` (``text``, ``json_object``, ``json_schema``),
llama-server's ``grammar`` (GBNF) and ``json_schema``, vLLM's ``structured_outputs`` (``choice``,
``regex``, ``json``, ``grammar``, ``json_object``) and its older ``guided_json`` / ``guided_regex`` /
``guided_choice`` / ``guided_grammar``. More than one in a request is a 400 naming them. The engine
compiles the constraint when it builds the request; one it cannot enforce is a 400 naming the field.

Fields of OpenAI's, llama-server's or vLLM's APIs that would change the output and that rsmem does not
implement are refused (400 naming the field) when set to anything but their neutral value
(:func:`refuse_unimplemented`), so no client is served looser than it asked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rsmem.engine.constraints import Constraint
from rsmem.errors import InvalidRequestError

JsonValue = dict[str, Any] | str  # a JSON schema, or its JSON text


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # rsmem always enforces the schema exactly


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="ignore", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # llama-server's shorthand


class StructuredOutputs(BaseModel):
    """vLLM's ``structured_outputs``; keys it has and rsmem does not (``structural_tag``, whitespace
    options) are refused by ``extra="forbid"``."""

    model_config = ConfigDict(extra="forbid")

    json_: JsonValue | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None  # rsmem never falls back to free generation


class StructuredFields(BaseModel):
    """The constraint fields both completion routes take (a base of ``schemas._SamplingFields``)."""

    model_config = ConfigDict(extra="ignore")

    response_format: ResponseFormat | None = None
    grammar: str | None = None  # llama-server: GBNF
    json_schema: dict[str, Any] | None = None  # llama-server
    structured_outputs: StructuredOutputs | None = None  # vLLM
    guided_json: JsonValue | None = None  # vLLM's older names
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # other APIs' fields rsmem does not implement: refused unless neutral (``refuse_unimplemented``)
    suffix: Any = None
    best_of: Any = None
    audio: Any = None
    modalities: Any = None
    web_search_options: Any = None
    n_predict: Any = None
    mirostat: Any = None
    typical_p: Any = None
    tfs_z: Any = None
    dynatemp_range: Any = None
    xtc_probability: Any = None
    dry_multiplier: Any = None
    min_tokens: Any = None
    repetition_penalty: Any = None
    stop_token_ids: Any = None
    bad_words: Any = None
    allowed_token_ids: Any = None
    include_stop_str_in_output: Any = None
    use_beam_search: Any = None
    prompt_logprobs: Any = None
    logits_processors: Any = None
    samplers: Any = None
    n_probs: Any = None
    post_sampling_probs: Any = None
    lora: Any = None


def _vllm_kinds(
    schema: JsonValue | None, regex: str | None, choice: list[str] | None, grammar: str | None, field: str
) -> list[Constraint]:
    """vLLM's four constraint fields, named ``field.format(kind)`` (``structured_outputs.json``,
    ``guided_json``, ...): the constraints of those that are set."""
    found = []
    if schema is not None:
        found.append(_schema(schema, field.format("json")))
    if regex is not None:
        found.append(Constraint.regex(regex, field=field.format("regex")))
    if choice is not None:
        found.append(Constraint.choice(choice, field=field.format("choice")))
    if grammar is not None:
        found.append(Constraint.grammar(grammar, field=field.format("grammar")))
    return found


def _schema(value: JsonValue, field: str) -> Constraint:
    return Constraint.json_schema(value, field=field)


def request_constraint(body: StructuredFields) -> Constraint | None:
    """The request's one constraint, or None; InvalidRequestError naming the fields when it asks for
    more than one, or naming the field whose value is malformed."""
    found: list[Constraint] = []
    rf = body.response_format
    if rf is not None and rf.type == "json_object":
        if rf.schema_ is not None:  # llama-server: a schema inside json_object
            found.append(_schema(rf.schema_, "response_format.schema"))
        else:
            found.append(Constraint.json_object(field="response_format"))
    elif rf is not None and rf.type == "json_schema":
        inner = rf.json_schema.schema_ if rf.json_schema is not None else None
        if inner is not None:
            found.append(_schema(inner, "response_format.json_schema.schema"))
        elif rf.schema_ is not None:
            found.append(_schema(rf.schema_, "response_format.schema"))
        else:
            raise InvalidRequestError("response_format.json_schema", "must hold a schema")
    if body.grammar is not None:
        found.append(Constraint.grammar(body.grammar, field="grammar"))
    if body.json_schema is not None:
        found.append(_schema(body.json_schema, "json_schema"))
    so = body.structured_outputs
    if so is not None:
        found += _vllm_kinds(so.json_, so.regex, so.choice, so.grammar, "structured_outputs.{}")
        if so.json_object:
            found.append(Constraint.json_object(field="structured_outputs.json_object"))
    found += _vllm_kinds(
        body.guided_json, body.guided_regex, body.guided_choice, body.guided_grammar, "guided_{}"
    )
    if len(found) > 1:
        fields = ", ".join(c.field for c in found)
        raise InvalidRequestError(
            found[1].field, f"is one constraint too many: a request takes one ({fields})"
        )
    return found[0] if found else None


def _neutral(*values: object) -> Callable[[object], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


# field -> (whether a value is neutral, why a set one is refused)
UNIMPLEMENTED: dict[str, tuple[Callable[[object], bool], str]] = {
    "suffix": (_neutral(""), "is not supported (no fill-in-the-middle)"),
    "best_of": (_neutral(1), "is not supported: use n"),
    "audio": (_neutral(), "is not supported (text only)"),
    "modalities": (_neutral(["text"]), 'is not supported beyond ["text"]'),
    "web_search_options": (_neutral(), "is not supported (no web search)"),
    "n_predict": (_neutral(), "is not supported: use max_tokens"),
    "mirostat": (_neutral(0), "is not supported (no mirostat sampler)"),
    "typical_p": (_neutral(1, 1.0), "is not supported (no typical sampler)"),
    "tfs_z": (_neutral(1, 1.0), "is not supported (no tail-free sampler)"),
    "dynatemp_range": (_neutral(0, 0.0), "is not supported (no dynamic temperature)"),
    "xtc_probability": (_neutral(0, 0.0), "is not supported (no XTC sampler)"),
    "dry_multiplier": (_neutral(0, 0.0), "is not supported (no DRY sampler)"),
    "min_tokens": (_neutral(0), "is not supported"),
    "repetition_penalty": (_neutral(1, 1.0), "is not supported here: use repeat_penalty"),
    "stop_token_ids": (_neutral([]), "is not supported: use stop"),
    "bad_words": (_neutral([]), "is not supported: use logit_bias"),
    "allowed_token_ids": (_neutral(), "is not supported: use logit_bias or a constraint"),
    "include_stop_str_in_output": (_neutral(False), "is not supported"),
    "use_beam_search": (_neutral(False), "is not supported (no beam search)"),
    "prompt_logprobs": (_neutral(), "is not supported"),
    "logits_processors": (_neutral(), "is not supported"),
    "samplers": (_neutral(), "is not supported (the sampler order is fixed)"),
    "n_probs": (_neutral(0), "is not supported: use logprobs"),
    "post_sampling_probs": (_neutral(False), "is not supported"),
    "lora": (_neutral([]), "is not supported (no adapters)"),
}


def refuse_unimplemented(body: StructuredFields) -> None:
    """InvalidRequestError naming the first field set that rsmem does not implement."""
    for name, (neutral, why) in UNIMPLEMENTED.items():
        value = getattr(body, name)
        if not neutral(value):
            raise InvalidRequestError(name, f"= {value!r} {why}")
