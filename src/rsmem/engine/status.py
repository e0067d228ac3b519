"""What the engine reports about itself: running totals, health, and one snapshot for servers."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

DEGRADED_SECONDS = 60.0  # a model failure keeps health "degraded" this long
ERROR_AFTER_FAILURES = 3  # consecutive failed decode steps that make health "error"


@dataclass(slots=True)
class EngineStats:
    """Running totals, for reports and the server's metrics."""

    steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    requests_finished: int = 0
    requests_failed: int = 0
    failed_steps: int = 0
    cache_hits_extension: int = 0  # prompts continued from a free sequence's own kept state
    cache_hits_rollback: int = 0  # prompts continued from a free sequence's state rolled back (n_rs_seq)
    cache_hits_checkpoint: int = 0  # prompts continued from a checkpoint of the prefix cache
    cache_misses: int = 0  # prompts computed from the start
    shared_prefix_waits: int = 0  # requests that waited for another's prefill of a shared prefix

    def count_cache_use(self, kind: str) -> None:
        """A prompt started: ``kind`` is "extension", "rollback", "checkpoint" or "miss"."""
        if kind == "extension":
            self.cache_hits_extension += 1
        elif kind == "rollback":
            self.cache_hits_rollback += 1
        elif kind == "checkpoint":
            self.cache_hits_checkpoint += 1
        else:
            self.cache_misses += 1


class Health:
    """``ok``, ``degraded`` (a model failure in the last minute) or ``error`` (the last few decode
    steps all failed and none has succeeded since)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._consecutive = 0
        self._last_failure: tuple[float, str] | None = None

    def step_failed(self, reason: str) -> None:
        self._consecutive += 1
        self._last_failure = (self._clock(), reason)

    def step_succeeded(self) -> None:
        self._consecutive = 0

    def status(self) -> tuple[str, str | None]:
        if self._last_failure is None:
            return "ok", None
        when, reason = self._last_failure
        if self._consecutive >= ERROR_AFTER_FAILURES:
            return "error", f"the last {self._consecutive} decode steps failed: {reason}"
        age = self._clock() - when
        if age < DEGRADED_SECONDS:
            return "degraded", f"a decode step failed {age:.0f} s ago: {reason}"
        return "ok", None


@dataclass(frozen=True, slots=True)
class SlotInfo:
    id: int
    busy: bool  # running a request or held by a session
    request_id: str | None
    n_cached_tokens: int  # tokens a free slot's kept state folds
    checkpoints: tuple[int, ...] = ()  # token counts of the prefix cache's checkpoints along those tokens


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """The engine's state at one moment, read in one call between steps."""

    n_slots: int
    waiting: int  # requests queued for sequences
    waiting_seqs: int  # sequences those requests need (their n)
    running: int
    free_slots: int
    slots: tuple[SlotInfo, ...]
    prompt_tokens: int
    cached_prompt_tokens: int
    generated_tokens: int
    decode_seconds: float
    steps: int
    requests_finished: int
    requests_failed: int
    cells_active: int  # memory cells of running requests and sessions
    cells_used: int  # cells in use, prompt cache included
    cells_total: int
    health: str
    health_reason: str | None
    cache_entries: int = 0  # checkpoints in the prefix cache
    cache_bytes: int = 0
    cache_evictions: int = 0
    checkpoints_taken: int = 0
    checkpoint_restores: int = 0  # requests that started from a checkpoint
    checkpoint_tokens: int = 0  # prompt tokens those checkpoints covered
    cache_hits_extension: int = 0
    cache_hits_rollback: int = 0
    cache_hits_checkpoint: int = 0
    cache_misses: int = 0
    disk_entries: int = 0  # checkpoint files in --cache-dir
    disk_bytes: int = 0
    disk_restores: int = 0  # restores read from --cache-dir
    disk_written: int = 0
    disk_write_errors: int = 0  # checkpoint files that could not be written
    disk_corrupt: int = 0  # files dropped as unreadable
    disk_evictions: int = 0
    checkpoints_added: int = 0  # from saved slots and sessions
