"""Request bodies of the OpenAI-compatible endpoints (pydantic): JSON types and OpenAI's documented
ranges, and text that is Unicode (JSON's ``\\ud800`` escapes can carry a lone UTF-16 surrogate, which no
tokenizer, template or response can take: an ``invalid_text`` error naming its JSON path, e.g.
``messages[0].content``). What depends on the model or the server's limits (vocabulary, slots, prompt
length, ``max_tokens`` limit) is checked by the engine, once."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from rsmem.engine.tokenizer import unicode_problem
from rsmem.server.structured import StructuredFields

INVALID_TEXT = "invalid_text"  # the pydantic error type of text that is not Unicode; ctx["path"] names it


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore")

    include_usage: bool = False  # a last chunk, before [DONE], with "choices": [] and the usage


class _SamplingFields(StructuredFields):  # the constraint fields and the refused ones: structured.py
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # llama.cpp server extensions
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    repeat_penalty: float = Field(default=1.0, gt=0.0)
    id_slot: int | None = Field(default=None, ge=-1)

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> list[str]:
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop sequences, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop sequences must not be empty")
        return stops

    def texts(self) -> Iterator[tuple[str, str]]:
        """Every text field of the request the server uses, with its JSON path."""
        for name in ("model", "user"):
            value = getattr(self, name)
            if value is not None:
                yield name, value
        stops = self.stop or []
        for i, stop in enumerate(stops):
            yield ("stop" if len(stops) == 1 else f"stop[{i}]"), stop

    @model_validator(mode="after")
    def _unicode(self) -> _SamplingFields:
        for path, text in self.texts():
            problem = unicode_problem(text)
            if problem is not None:
                context = {"path": path, "problem": problem}
                raise PydanticCustomError(INVALID_TEXT, "{path} {problem}", context)
        return self

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for token, bias in (v or {}).items():
            if not token.lstrip("-").isdigit():
                raise ValueError(f"logit_bias key {token!r} is not a token id")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"logit_bias of token {token} is {bias}, outside [-100, 100]")
        return v


PromptField = str | list[int] | list[str] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: PromptField
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    max_tokens: int | None = Field(default=16, ge=1)
    return_token_ids: bool = False  # extension (as vLLM): each choice also lists its token ids

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v: PromptField) -> PromptField:
        if isinstance(v, list) and not v:
            raise ValueError("prompt must not be empty")
        return v

    def texts(self) -> Iterator[tuple[str, str]]:
        yield from super().texts()
        if isinstance(self.prompt, str):
            yield "prompt", self.prompt
            return
        for i, p in enumerate(self.prompt):
            if isinstance(p, str):
                yield f"prompt[{i}]", p


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    arguments: str | dict[str, object] = "{}"  # OpenAI sends a JSON string; a mapping is taken too


class MessageToolCall(BaseModel):
    """A call an earlier assistant turn made (sent back in the conversation)."""

    model_config = ConfigDict(extra="ignore")

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str
    description: str | None = None
    parameters: dict[str, object] | None = None  # a JSON schema of the arguments (an object)
    strict: bool | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    function: NamedFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, object]] | None = None
    name: str | None = None
    tool_call_id: str | None = None  # a tool message: the call it answers
    tool_calls: list[MessageToolCall] | None = None  # an assistant message: the calls it made
    reasoning_content: str | None = None  # an assistant message: its thinking (as this server returns it)
    reasoning: str | None = None  # the same, as some clients name it

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(str(part.get("text", "")) for part in self.content if part.get("type") == "text")
        return self.content or ""

    def texts(self, path: str) -> Iterator[tuple[str, str]]:
        """The text this message gives the chat template, with its JSON path (``path`` is the message's)."""
        if isinstance(self.content, str):
            yield f"{path}.content", self.content
        for j, part in enumerate(self.content if isinstance(self.content, list) else ()):
            text = part.get("text")
            if part.get("type") == "text" and isinstance(text, str):
                yield f"{path}.content[{j}].text", text
        for name in ("name", "tool_call_id", "reasoning_content", "reasoning"):
            value = getattr(self, name)
            if value is not None:
                yield f"{path}.{name}", value
        for j, call in enumerate(self.tool_calls or ()):
            yield f"{path}.tool_calls[{j}].function.name", call.function.name
            if isinstance(call.function.arguments, str):
                yield f"{path}.tool_calls[{j}].function.arguments", call.function.arguments


class ChatRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True

    def texts(self) -> Iterator[tuple[str, str]]:
        yield from super().texts()
        for i, m in enumerate(self.messages):
            yield from m.texts(f"messages[{i}]")
        for i, tool in enumerate(self.tools or ()):
            yield f"tools[{i}].function.name", tool.function.name
            if tool.function.description is not None:
                yield f"tools[{i}].function.description", tool.function.description


class SlotAction(BaseModel):
    model_config = ConfigDict(extra="ignore")

    filename: str | None = None
