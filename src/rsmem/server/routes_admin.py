"""Operations endpoints: ``/health``, ``/metrics``, and llama.cpp's ``/slots``.

Engine state is read through one ``Engine.snapshot()`` per answer (taken on the engine thread).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Body, Request
from fastapi.responses import JSONResponse, PlainTextResponse

from rsmem.engine.status import EngineSnapshot
from rsmem.errors import InvalidRequestError, RsmemError
from rsmem.server.errors import SERVER, ApiError, invalid_request
from rsmem.server.runner import EngineStoppedError
from rsmem.server.schemas import SlotAction
from rsmem.server.state import AppState, app_state

router = APIRouter()
T = TypeVar("T")

HEALTH_TIMEOUT = 10.0  # seconds /health waits for the engine thread before it answers "error"
MAX_FILENAME = 200
SAFE_FILENAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")


async def snapshot(state: AppState, timeout: float | None = None) -> EngineSnapshot:
    try:
        return await state.runner.snapshot(timeout=timeout)
    except EngineStoppedError as exc:
        raise ApiError(503, str(exc), kind=SERVER, code="engine_stopped") from exc


@router.get("/health")
async def health(request: Request) -> JSONResponse:
    """``ok``, ``degraded`` (a model failure in the last minute; ``reason`` names it) or ``error``
    (the engine thread stopped, does not answer, or its last decode steps all failed): 503 then."""
    state = app_state(request)
    n = state.runner.n_slots
    body: dict[str, Any] = {"status": "error", "reason": None, "slots_idle": 0, "slots_processing": n}
    if not state.runner.alive:
        body["reason"] = "the engine thread is not running"
        return JSONResponse(body, status_code=503)
    try:
        snap = await state.runner.snapshot(timeout=HEALTH_TIMEOUT)
    except (TimeoutError, EngineStoppedError):
        body["reason"] = f"the engine thread did not answer within {HEALTH_TIMEOUT:.0f} s"
        return JSONResponse(body, status_code=503)
    busy = sum(1 for s in snap.slots if s.busy)
    body = {
        "status": snap.health,
        "reason": snap.health_reason,
        "slots_idle": n - busy,
        "slots_processing": busy,
    }
    return JSONResponse(body, status_code=503 if snap.health == "error" else 200)


@router.get("/metrics")
async def metrics(request: Request) -> PlainTextResponse:
    state = app_state(request)
    m = await snapshot(state)
    requests = (
        f'rsmem_requests_total{{path="{path}",code="{code}"}} {count}'
        for (path, code), count in sorted(state.counts.items())
    )
    tokens_per_second = (m.prompt_tokens + m.generated_tokens) / m.decode_seconds if m.decode_seconds else 0.0
    lines = [
        "# HELP rsmem_requests_total HTTP requests by route and status code.",
        "# TYPE rsmem_requests_total counter",
        *requests,
        _metric(
            "rsmem_prompt_tokens_total", "counter", "Prompt tokens processed by the model.", m.prompt_tokens
        ),
        _metric(
            "rsmem_prompt_tokens_cached_total",
            "counter",
            "Prompt tokens skipped because a cached state covered them.",
            m.cached_prompt_tokens,
        ),
        _metric("rsmem_generation_tokens_total", "counter", "Tokens generated.", m.generated_tokens),
        _metric(
            "rsmem_decode_seconds_total", "counter", "Seconds spent in model decode steps.", m.decode_seconds
        ),
        _metric("rsmem_decode_steps_total", "counter", "Model decode steps that succeeded.", m.steps),
        _metric(
            "rsmem_tokens_per_second",
            "gauge",
            "Tokens processed per second of decode time.",
            tokens_per_second,
        ),
        _metric(
            "rsmem_requests_finished_total", "counter", "Requests finished (any reason).", m.requests_finished
        ),
        _metric(
            "rsmem_requests_failed_total", "counter", "Requests finished with an error.", m.requests_failed
        ),
        _metric("rsmem_queue_length", "gauge", "Requests waiting for a slot.", m.waiting),
        _metric("rsmem_requests_running", "gauge", "Requests holding slots.", m.running),
        _metric(
            "rsmem_memory_cells_active", "gauge", "Memory cells held by running requests.", m.cells_active
        ),
        _metric(
            "rsmem_memory_cells_used", "gauge", "Memory cells in use, prompt cache included.", m.cells_used
        ),
        _metric("rsmem_memory_cells_total", "gauge", "Memory cells (= parallel slots).", m.cells_total),
        _metric(
            "rsmem_prefix_cache_checkpoints", "gauge", "Checkpoints in the prefix cache.", m.cache_entries
        ),
        _metric(
            "rsmem_prefix_cache_bytes", "gauge", "Bytes of checkpoints in the prefix cache.", m.cache_bytes
        ),
        _metric(
            "rsmem_prefix_cache_evictions_total",
            "counter",
            "Checkpoints evicted for room.",
            m.cache_evictions,
        ),
        _metric("rsmem_checkpoints_taken_total", "counter", "Checkpoints taken.", m.checkpoints_taken),
        _metric(
            "rsmem_checkpoints_added_total",
            "counter",
            "Checkpoints added from restored slot and session files.",
            m.checkpoints_added,
        ),
        _metric("rsmem_cache_dir_checkpoints", "gauge", "Checkpoint files in --cache-dir.", m.disk_entries),
        _metric("rsmem_cache_dir_bytes", "gauge", "Bytes of checkpoint files in --cache-dir.", m.disk_bytes),
        _metric(
            "rsmem_cache_dir_restores_total", "counter", "Restores read from --cache-dir.", m.disk_restores
        ),
        _metric("rsmem_cache_dir_written_total", "counter", "Checkpoint files written.", m.disk_written),
        _metric(
            "rsmem_cache_dir_write_errors_total",
            "counter",
            "Checkpoint files that could not be written.",
            m.disk_write_errors,
        ),
        _metric("rsmem_cache_dir_corrupt_total", "counter", "Unreadable files dropped.", m.disk_corrupt),
        _metric("rsmem_cache_dir_evictions_total", "counter", "Checkpoint files deleted.", m.disk_evictions),
        "# HELP rsmem_prompt_cache_hits_total Prompts continued from a kept state, by kind.",
        "# TYPE rsmem_prompt_cache_hits_total counter",
        f'rsmem_prompt_cache_hits_total{{kind="extension"}} {m.cache_hits_extension}',
        f'rsmem_prompt_cache_hits_total{{kind="rollback"}} {m.cache_hits_rollback}',
        f'rsmem_prompt_cache_hits_total{{kind="checkpoint"}} {m.cache_hits_checkpoint}',
        _metric(
            "rsmem_prompt_cache_misses_total", "counter", "Prompts computed from the start.", m.cache_misses
        ),
        _metric(
            "rsmem_checkpoint_restores_total",
            "counter",
            "Requests that started from a checkpoint of the prefix cache.",
            m.checkpoint_restores,
        ),
        _metric(
            "rsmem_checkpoint_tokens_total",
            "counter",
            "Prompt tokens covered by restored checkpoints (not computed).",
            m.checkpoint_tokens,
        ),
        _metric(
            "rsmem_healthy", "gauge", "1 when health is ok, 0.5 when degraded, 0 on error.", _health_value(m)
        ),
    ]
    return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")


def _metric(name: str, kind: str, help_text: str, value: float) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n{name} {value}"


def _health_value(m: EngineSnapshot) -> float:
    return {"ok": 1.0, "degraded": 0.5}.get(m.health, 0.0)


@router.get("/slots")
async def slots(request: Request) -> list[dict[str, Any]]:
    snap = await snapshot(app_state(request))
    return [
        {
            "id": s.id,
            "busy": s.busy,
            "request_id": s.request_id,
            "n_cached_tokens": s.n_cached_tokens,
            "checkpoints": list(s.checkpoints),
        }
        for s in snap.slots
    ]


@router.post("/slots/{slot_id}")
async def slot_action(
    slot_id: int, action: str, request: Request, body: Annotated[SlotAction | None, Body()] = None
) -> dict[str, Any]:
    """``action=save|restore`` with ``{"filename": ...}`` (a file under ``--slot-save-path``), or
    ``erase``. Every refusal is a 400 that names no server path (409 for a busy slot)."""
    state = app_state(request)
    t0 = time.perf_counter()
    if action == "erase":
        n = await _slot_call(state, lambda: state.runner.engine.slot_erase(slot_id), "erase", None)
        return {"id_slot": slot_id, "n_erased": n, "timings": {"erase_ms": (time.perf_counter() - t0) * 1e3}}
    if action not in ("save", "restore"):
        raise ApiError(400, f"unknown action {action!r}: use save, restore or erase", param="action")
    folder = state.settings.slot_save_path
    if folder is None:
        raise ApiError(400, "slot save/restore is disabled: start the server with --slot-save-path")
    filename = _check_filename(body.filename if body is not None else None)
    path = folder / filename
    engine = state.runner.engine
    if action == "save":
        n_tokens, n_bytes = await _slot_call(
            state, lambda: engine.slot_save(slot_id, str(path)), filename, folder
        )
        ms = (time.perf_counter() - t0) * 1e3
        return {
            "id_slot": slot_id,
            "filename": filename,
            "n_saved": n_tokens,
            "n_written": n_bytes,
            "timings": {"save_ms": ms},
        }
    if not path.is_file():
        raise ApiError(400, f"no saved slot file {filename!r}", param="filename")
    n_read = path.stat().st_size
    n_tokens = await _slot_call(state, lambda: engine.slot_restore(slot_id, str(path)), filename, folder)
    ms = (time.perf_counter() - t0) * 1e3
    return {
        "id_slot": slot_id,
        "filename": filename,
        "n_restored": n_tokens,
        "n_read": n_read,
        "timings": {"restore_ms": ms},
    }


def _check_filename(filename: str | None) -> str:
    if not filename or len(filename) > MAX_FILENAME or not SAFE_FILENAME.match(filename) or ".." in filename:
        shown = filename if filename is None or len(filename) <= 40 else filename[:40] + "..."
        raise ApiError(
            400,
            f"invalid filename {shown!r}: use 1 to {MAX_FILENAME} letters, digits, '_', '-' and '.', "
            "no path separators or '..'",
            param="filename",
        )
    return filename


async def _slot_call(state: AppState, fn: Callable[[], T], filename: str, folder: Path | None) -> T:
    """Run a slot operation on the engine thread; its errors become 400s that name no server path."""
    try:
        return await state.runner.call(fn)
    except InvalidRequestError as exc:  # a slot that does not exist
        raise invalid_request(exc) from exc
    except EngineStoppedError as exc:
        raise ApiError(503, str(exc), kind=SERVER, code="engine_stopped") from exc
    except RuntimeError as exc:  # a busy slot
        raise ApiError(409, str(exc), param="id_slot") from exc
    except OSError as exc:
        raise ApiError(
            400, f"slot file {filename!r}: {exc.strerror or type(exc).__name__}", param="filename"
        ) from exc
    except (RsmemError, ValueError) as exc:  # a corrupt or mismatched state file
        raise ApiError(
            400, f"slot file {filename!r}: {_without_paths(str(exc), folder)}", param="filename"
        ) from exc


def _without_paths(message: str, folder: Path | None) -> str:
    """The message with the slot folder and any other absolute path taken out."""
    if folder is not None:
        message = message.replace(str(folder.resolve()) + "/", "").replace(str(folder) + "/", "")
    return re.sub(r"(?<![\w.])/[^\s'\",:]+", "<path>", message)
