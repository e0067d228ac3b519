"""Fixtures of the server tests: one LLM for the session, and a live server on it per module
(helpers/server.py holds ``start_server`` and ``LiveServer``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from helpers.server import LiveServer, model_path, start_server
from rsmem.engine import LLM


@pytest.fixture(scope="session")
def shared_llm() -> LLM:
    return LLM(model_path(), n_seq_max=4, n_batch=256)


@pytest.fixture(scope="module")
def live(shared_llm: LLM, tmp_path_factory) -> Iterator[LiveServer]:
    slot_dir = tmp_path_factory.mktemp("slots")
    with start_server(
        shared_llm, slot_save_path=slot_dir, max_prompt_tokens=200, max_tokens_limit=64, max_body_bytes=20_000
    ) as server:
        yield server
