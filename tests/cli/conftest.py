"""Fixtures for running ``rsmem.cli.main`` in-process: stdin as bytes, and a model loaded once."""

from __future__ import annotations

import io
import sys

import pytest

from rsmem.cli import chat, generate
from rsmem.engine import LLM, default_model_path, load_text_model


@pytest.fixture(scope="session")
def text_model():
    return load_text_model(default_model_path())


@pytest.fixture
def fast_load(monkeypatch, text_model):
    """``generate`` and ``chat`` get a fresh context over the model loaded once for the session; the
    list records each load's ``n_seq_max``."""
    model, tokenizer = text_model
    loads: list[int] = []

    def load(args, n_seq_max):
        loads.append(n_seq_max)
        return LLM(model, tokenizer=tokenizer, n_seq_max=n_seq_max, n_batch=512)

    monkeypatch.setattr(generate, "load", load)
    monkeypatch.setattr(chat, "load", load)
    return loads


@pytest.fixture
def no_load(monkeypatch):
    """Fail the test if a command loads a model (for errors that must come before any work)."""

    def load(args, n_seq_max):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(generate, "load", load)
    monkeypatch.setattr(chat, "load", load)


@pytest.fixture
def stdin_bytes(monkeypatch):
    """``set(data)`` makes ``sys.stdin`` a pipe-like stream holding ``data``."""

    def set_stdin(data: bytes) -> None:
        monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))

    return set_stdin
