"""Chat prompts: the model's own template when its file has one, a plain documented one otherwise."""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rsmem.errors import ModelFormatError

PLAIN_STOP = ("\nUser:",)


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    """Renders OpenAI-style messages into one prompt string.

    The plain template, used when the model file carries none::

        {system content}\\n\\n            (only when there is a system message)
        User: {content}\\n
        Assistant: {content}\\n
        ...
        Assistant:

    and generation stops at ``\\nUser:``, so the model does not write the user's next turn.
    """

    source: str | None = None  # a Jinja template from the model file, or None for the plain one
    bos_token: str = ""
    eos_token: str = ""

    @property
    def stop(self) -> tuple[str, ...]:
        return () if self.source else PLAIN_STOP

    @property
    def knows_tools(self) -> bool:
        """The template renders a ``tools`` list itself (its source names ``tools``)."""
        return bool(self.source) and "tools" in (self.source or "")

    @property
    def thinks(self) -> bool:
        """The template's model writes its reasoning between ``<think>`` and ``</think>``."""
        return bool(self.source) and "</think>" in (self.source or "")

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        """The prompt of ``messages``; ``tools`` (OpenAI's tool objects) go to a Jinja template as
        transformers' ``apply_chat_template(messages, tools=...)`` passes them (the plain template has
        no place for them: the caller puts them in a message)."""
        if self.source:
            return _compiled(self.source).render(
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        return "".join(self._plain_parts(messages)) + ("Assistant:" if add_generation_prompt else "")

    def message_prefixes(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None
    ) -> list[str]:
        """The rendered conversation up to the end of each message (no generation prompt): where the
        prefix cache keeps checkpoints, so the next turn re-sending them computes only what is new."""
        if self.source:
            prefixes = []
            for k in range(1, len(messages) + 1):
                try:  # a template may refuse a partial conversation: no checkpoint there, then
                    prefixes.append(self.render(messages[:k], add_generation_prompt=False, tools=tools))
                except Exception:
                    continue
            return prefixes
        parts = self._plain_parts(messages)
        return ["".join(parts[:k]) for k in range(1, len(parts) + 1)]

    @staticmethod
    def _plain_parts(messages: list[dict[str, Any]]) -> list[str]:
        parts = []
        for m in messages:
            if m["role"] == "system":
                parts.append(f"{m['content']}\n\n")
            elif m["role"] == "assistant":  # an answer as generated after "Assistant:" keeps its space
                content = m["content"]
                parts.append(f"Assistant:{content if content[:1].isspace() else ' ' + content}\n")
            else:
                parts.append(f"User: {m['content']}\n")
        return parts


@functools.lru_cache(maxsize=8)
def _compiled(source: str) -> Any:
    """A Jinja template compiled once (a chat turn renders it once per message for the boundaries)."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson  # transformers' filter: plain JSON, no HTML escaping
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _raise_exception(message: str) -> None:
    """What a template calls to refuse a conversation (the route answers 400 with the message)."""
    raise ValueError(message)


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


def load_chat_template(model_path: str | Path) -> str | None:
    """``tokenizer.chat_template`` of a GGUF file, or ``chat_template`` of an HF folder's tokenizer config."""
    path = Path(model_path)
    if path.is_dir():
        config = path / "tokenizer_config.json"
        if config.is_file():
            value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            return value if isinstance(value, str) else None
        return None
    from rsmem.loaders.tensor_types import open_reader

    field = open_reader(path).get_field("tokenizer.chat_template")
    if field is None:
        return None
    try:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    except UnicodeDecodeError as exc:
        key = "tokenizer.chat_template"
        raise ModelFormatError(f"{path}: metadata key {key!r} is not UTF-8 text ({exc})") from exc
