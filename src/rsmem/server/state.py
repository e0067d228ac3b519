"""The one object every route reads: the engine runner, the settings, the metrics counters, the tokenizer."""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import Request

from rsmem.engine import TextTokenizer
from rsmem.server.chat import ChatTemplate
from rsmem.server.runner import EngineRunner


@dataclass(slots=True)
class ServerSettings:
    """What the routes need to know of the server's configuration (built once, by ``build_app``).

    ``max_prompt_tokens`` and ``max_tokens_limit`` are enforced by the engine (``Engine(...,
    max_prompt_tokens=, max_tokens_limit=)``); the server keeps them only to name the flag in its
    error messages and to cap the default ``max_tokens`` of a chat request.
    """

    model_name: str = "rsmem"
    model_aliases: frozenset[str] = frozenset()  # other names a request's "model" may use
    api_key: str | None = None
    slot_save_path: Path | None = None
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int | None = 4096
    max_tokens_limit: int | None = 4096
    default_chat_max_tokens: int = 256
    chat_template: ChatTemplate = field(default_factory=ChatTemplate)
    cors_origins: tuple[str, ...] = ()

    def accepts_model(self, name: str | None) -> bool:
        """A request may name the served model (its name, alias, file name or stem) or none."""
        return name is None or name == self.model_name or name in self.model_aliases

    @property
    def chat_max_tokens(self) -> int:
        """``max_tokens`` of a chat request that sets none: the default, capped by the server limit."""
        limit = self.max_tokens_limit
        return self.default_chat_max_tokens if limit is None else min(self.default_chat_max_tokens, limit)


@dataclass(slots=True)
class AppState:
    """Shared by every route and middleware of one app (``request.app.state.rsmem``)."""

    runner: EngineRunner
    settings: ServerSettings
    tokenizer: TextTokenizer | None
    counts: Counter[tuple[str, int]] = field(default_factory=Counter)  # (route template, status)
    started: float = field(default_factory=time.time)
    accepting: bool = True  # False once a graceful shutdown began: new requests get 503

    def token_text(self, token: int) -> str:
        return self.tokenizer.token_text(token) if self.tokenizer is not None else str(token)


def app_state(request: Request) -> AppState:
    state: AppState = request.app.state.rsmem
    return state
