"""Fixtures shared by tests in several folders."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from rsmem import context as context_module
from rsmem import threads


@pytest.fixture
def busy_neighbour(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The automatic count on sleeping threads, with another process's thread runnable (as loadavg says)."""
    monkeypatch.setattr(threads, "_auto_count", True)
    monkeypatch.setattr(threads, "_PASSIVE", True)
    monkeypatch.setattr(threads, "others_runnable", lambda path=threads.LOADAVG: 1)
    monkeypatch.delenv("RSMEM_BUSY_THREADS", raising=False)
    torch.set_num_threads(threads.all_cores())
    return monkeypatch


@pytest.fixture
def prompt_thread_counts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The thread counts at which ``Context.decode``'s :func:`rsmem.threads.prompt_threads` blocks ran,
    appended as they run."""
    counts: list[int] = []
    raise_threads = threads.prompt_threads

    @contextmanager
    def spy(tokens_per_seq: int) -> Iterator[None]:
        with raise_threads(tokens_per_seq):
            counts.append(torch.get_num_threads())
            yield

    monkeypatch.setattr(context_module, "prompt_threads", spy)
    return counts
