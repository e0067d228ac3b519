"""A ``--cache-dir`` that cannot be written: one warning at start when the folder is not writable (its files
are still served, nothing is written), failed writes counted as write errors and never as written, and
``rsmem_cache_dir_write_errors_total`` in ``/metrics``."""

from __future__ import annotations

import errno
import logging
import os
from pathlib import Path

import httpx
import pytest

from helpers.server import MODEL, start_server
from rsmem import Context
from rsmem.engine import Engine, SamplingParams
from rsmem.engine import cache_dir as cache_dir_module
from rsmem.engine.cache_dir import WRITER
from rsmem.models import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba2

pytestmark = pytest.mark.subprocess

N_VOCAB = 64
PROMPT = [(1 + 7 * k) % N_VOCAB for k in range(44)]  # long enough for several checkpoints
GREEDY = SamplingParams.greedy(max_tokens=4)


@pytest.fixture(scope="module")
def model():
    cfg = Mamba2Config(d_model=32, n_layer=2, n_vocab=N_VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=4)
    return random_mamba2(cfg, seed=3)


def engine_for(model, folder: Path) -> Engine:
    ctx = Context(model, n_seq_max=2, n_batch=64, n_ubatch=16)
    return Engine(ctx, prompt_cache=True, cache_bytes=1 << 24, checkpoint_interval=8, cache_dir=folder)


def run(engine: Engine, prompt: list[int]) -> tuple[int, ...]:
    rid = engine.add_request(prompt, GREEDY)
    out = next(o for o in engine.run_until_done() if o.finished and o.request_id == rid)
    return out.outputs[0].token_ids


def disk(engine: Engine) -> cache_dir_module.DiskCache:
    assert engine.checkpoints is not None and engine.checkpoints.disk is not None
    return engine.checkpoints.disk


def failing_replace(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Renames into ``folder`` fail as on a full disk (other renames go on)."""
    replace = os.replace

    def refuse(src: str, dst: str | os.PathLike[str]) -> None:
        if Path(dst).is_relative_to(folder):
            raise OSError(errno.ENOSPC, "No space left on device")
        replace(src, dst)

    monkeypatch.setattr(cache_dir_module.os, "replace", refuse)


def not_writable(monkeypatch: pytest.MonkeyPatch) -> None:
    """Creating files in the cache dir fails as in a read-only folder (root ignores chmod)."""

    def refuse(*args: object, **kwargs: object) -> tuple[int, str]:
        raise PermissionError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(cache_dir_module.tempfile, "mkstemp", refuse)


def test_failed_writes_are_counted_as_errors_not_as_written(model, tmp_path, monkeypatch, caplog) -> None:
    engine = engine_for(model, tmp_path)
    failing_replace(monkeypatch, tmp_path)
    with caplog.at_level(logging.WARNING, logger="rsmem.cache_dir"):
        run(engine, PROMPT)
        WRITER.flush()
    stats = disk(engine).stats
    assert stats.write_errors >= 2 and stats.written == 0
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "cannot write" in warnings[0].getMessage()
    assert not list(disk(engine).dir.glob("*.rsck")) and not list(disk(engine).dir.glob("*.tmp"))
    snap = engine.snapshot()
    assert (snap.disk_written, snap.disk_write_errors) == (0, stats.write_errors)
    # the entries whose file is missing are forgotten quietly, not dropped as corrupt files
    monkeypatch.undo()
    with caplog.at_level(logging.WARNING, logger="rsmem.cache_dir"):
        run(engine, [*PROMPT[:40], 5, 6, 7])
        WRITER.flush()
    assert stats.corrupt == 0 and len(caplog.records) == 1
    assert stats.written >= 1  # writes work again
    assert stats.written == len(list(disk(engine).dir.glob("*.rsck")))


def test_a_folder_that_is_not_writable_warns_once_and_is_still_read(model, tmp_path, monkeypatch, caplog):
    first = engine_for(model, tmp_path)
    want = run(first, PROMPT)
    WRITER.flush()
    files = sorted(p.name for p in disk(first).dir.iterdir())
    assert files and disk(first).stats.written == len(files)
    not_writable(monkeypatch)
    with caplog.at_level(logging.WARNING, logger="rsmem.cache_dir"):
        restarted = engine_for(model, tmp_path)
        assert run(restarted, PROMPT) == want
        run(restarted, [*PROMPT[:20], *[9] * 11])
        WRITER.flush()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and "is not writable" in messages[0] and "kept in RAM only" in messages[0]
    stats = disk(restarted).stats
    assert (stats.written, stats.write_errors, stats.corrupt) == (0, 0, 0)
    assert restarted.checkpoints is not None and restarted.checkpoints.stats.disk_restores >= 1
    assert sorted(p.name for p in disk(restarted).dir.iterdir()) == files  # nothing written or deleted


def test_metrics_export_write_errors(shared_llm, tmp_path, monkeypatch) -> None:
    cache = tmp_path / "cache"
    failing_replace(monkeypatch, cache)
    with start_server(shared_llm, cache_dir=cache, max_tokens_limit=16) as server:
        body = {"model": MODEL, "prompt": "ROMEO: " + "the king is dead " * 30, "max_tokens": 2}
        assert httpx.post(f"{server.base_url}/completions", json=body, timeout=60).status_code == 200
        WRITER.flush()
        values = server.snapshot()
    assert values["rsmem_cache_dir_write_errors_total"] >= 1
    assert values["rsmem_cache_dir_written_total"] == 0
