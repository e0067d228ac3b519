"""Chat prompts: the model's own template when its file has one, a plain documented one otherwise."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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

    def render(self, messages: list[dict[str, str]]) -> str:
        if self.source:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            template = env.from_string(self.source)
            return template.render(
                messages=messages,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        parts = []
        for m in messages:
            if m["role"] == "system":
                parts.append(f"{m['content']}\n\n")
            elif m["role"] == "assistant":
                parts.append(f"Assistant: {m['content']}\n")
            else:
                parts.append(f"User: {m['content']}\n")
        parts.append("Assistant:")
        return "".join(parts)


def load_chat_template(model_path: str | Path) -> str | None:
    """``tokenizer.chat_template`` of a GGUF file, or ``chat_template`` of an HF folder's tokenizer config."""
    path = Path(model_path)
    if path.is_dir():
        config = path / "tokenizer_config.json"
        if config.is_file():
            value = json.loads(config.read_text(encoding="utf-8")).get("chat_template")
            return value if isinstance(value, str) else None
        return None
    import gguf

    reader = gguf.GGUFReader(path)
    field = reader.get_field("tokenizer.chat_template")
    if field is None:
        return None
    return bytes(field.parts[field.data[0]]).decode("utf-8")
