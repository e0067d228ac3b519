"""Persistence of checkpoints: slots and sessions keep theirs in a companion of the llama.cpp sequence
file, and ``cache_dir`` keeps the prefix cache on disk across restarts (read lazily). A corrupt or foreign
file is skipped with a warning and never served; every result equals a fresh computation."""

from __future__ import annotations

import logging
import threading

import pytest

from rsmem import Context
from rsmem.engine import Engine, SamplingParams
from rsmem.engine import cache_dir as cache_dir_module
from rsmem.engine.cache_dir import WRITER
from rsmem.engine.kept import companion_path
from rsmem.memory import checkpoint_file as cf
from rsmem.models import DecayedSumModel, Mamba2Config
from rsmem.models.mamba.random_init import random_mamba2

N_VOCAB = 64
GREEDY = SamplingParams.greedy(max_tokens=6)
INTERVAL = 8


def make_model(name: str, seed: int = 3, n_layer: int = 2):
    if name == "toy":
        return DecayedSumModel(n_vocab=N_VOCAB, n_embd=6, n_layer=n_layer + 1, seed=seed + 1)
    cfg = Mamba2Config(
        d_model=32, n_layer=n_layer, n_vocab=N_VOCAB, d_state=8, n_head=4, n_group=2, chunk_size=4
    )
    return random_mamba2(cfg, seed=seed)


def engine_for(model, **kw) -> Engine:
    kw.setdefault("cache_bytes", 1 << 24)
    kw.setdefault("checkpoint_interval", INTERVAL)
    return Engine(Context(model, n_seq_max=2, n_batch=64, n_ubatch=16), prompt_cache=True, **kw)


def run(engine: Engine, prompt: list[int], **kw):
    rid = engine.add_request(prompt, GREEDY, **kw)
    return next(o for o in engine.run_until_done() if o.finished and o.request_id == rid)


def fresh(model, prompt: list[int]) -> tuple[int, ...]:
    return run(Engine(Context(model, n_seq_max=1, n_batch=64, n_ubatch=16)), prompt).outputs[0].token_ids


def seq(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % N_VOCAB for k in range(n)]


HISTORY = seq(1, 44)
DIVERGING = HISTORY[:42] + seq(9, 5)  # leaves the saved history at 42: checkpoints at 8..40 are along it


def saved_slot(model, tmp_path, *, slot: int = 0):
    """Turn one in ``slot``, saved: the sequence file's path and the tokens it holds."""
    engine = engine_for(model)
    run(engine, HISTORY, slot=slot)
    path = tmp_path / "slot.ggsq"
    n_tokens, _ = engine.slot_save(slot, str(path))
    return path, n_tokens


@pytest.mark.parametrize("name", ["toy", "mamba2"])
def test_a_restored_slot_serves_a_prompt_leaving_its_history_from_a_checkpoint(name, tmp_path):
    model = make_model(name)
    path, n_tokens = saved_slot(model, tmp_path)
    assert companion_path(path).is_file()
    restarted = engine_for(model)  # a new process: an empty cache
    assert restarted.slot_restore(0, str(path)) == n_tokens
    assert len(restarted.checkpoints) >= 5  # 8, 16, 24, 32, 40, 43 (prompt end), and the state itself
    out = run(restarted, DIVERGING)
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == fresh(model, DIVERGING)


def test_without_the_companion_the_same_prompt_computes_from_zero(tmp_path):
    """The control of the test above: a plain llama.cpp file restores only the slot's own state."""
    model = make_model("toy")
    path, n_tokens = saved_slot(model, tmp_path)
    companion_path(path).unlink()
    restarted = engine_for(model)
    assert restarted.slot_restore(0, str(path)) == n_tokens
    out = run(restarted, DIVERGING)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh(model, DIVERGING)


def test_the_restored_state_itself_serves_a_regenerate_in_another_slot(tmp_path):
    model = make_model("mamba2")
    path, n_tokens = saved_slot(model, tmp_path)
    restarted = engine_for(model)
    restarted.slot_restore(0, str(path))
    held = restarted.pool.cached_tokens(0)
    follow = [*held, 5, 6]
    out = run(restarted, follow, slot=1)  # not the restored slot: only the cache can serve it
    assert out.num_cached_tokens == n_tokens
    assert out.outputs[0].token_ids == fresh(model, follow)


@pytest.mark.parametrize("damage", ["flip", "truncate", "other-tokens"])
def test_a_corrupt_companion_is_skipped_with_a_warning_and_the_slot_still_restores(damage, tmp_path, caplog):
    model = make_model("toy")
    path, n_tokens = saved_slot(model, tmp_path)
    comp = companion_path(path)
    data = bytearray(comp.read_bytes())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10  # inside a record's rows
    elif damage == "truncate":
        del data[-7:]
    else:  # the sequence file was replaced by another conversation's
        other = engine_for(model)
        run(other, seq(5, 30), slot=0)
        other.slot_save(0, str(path))
    comp.write_bytes(bytes(data))
    restarted = engine_for(model)
    with caplog.at_level(logging.WARNING, logger="rsmem.kept"):
        n = restarted.slot_restore(0, str(path))
    assert "checkpoints of slot.ggsq skipped" in caplog.text
    assert n == (30 + GREEDY.max_tokens - 1 if damage == "other-tokens" else n_tokens)
    assert restarted.checkpoints.stats.added == 0
    out = run(restarted, DIVERGING)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh(model, DIVERGING)


def test_a_companion_from_another_model_or_shape_is_refused(tmp_path, caplog):
    path, _ = saved_slot(make_model("mamba2", seed=3), tmp_path)
    for other in (make_model("mamba2", seed=4), make_model("mamba2", seed=3, n_layer=3)):
        caplog.clear()
        restarted = engine_for(other)
        with caplog.at_level(logging.WARNING, logger="rsmem.kept"):
            try:
                restarted.slot_restore(0, str(path))
            except ValueError:  # the sequence file itself does not fit the other shape
                assert other.n_layer == 3
                continue
        assert "another model" in caplog.text
        assert restarted.checkpoints.stats.added == 0
    with pytest.raises(cf.CheckpointFileError, match="another shape"):
        three = engine_for(make_model("mamba2", seed=3, n_layer=3)).checkpoints
        cf.parse_file(
            companion_path(path).read_bytes(),
            kind=cf.KIND_COMPANION,
            layout=three.layout,
            fingerprint=three.fingerprint,
            key_tokens=[],
        )


def test_a_session_file_keeps_the_checkpoints_along_its_tokens(tmp_path):
    model = make_model("mamba2")
    engine = engine_for(model)
    run(engine, HISTORY)  # checkpoints along HISTORY
    session = engine.open_session()
    engine.add_request(HISTORY, GREEDY, session=session)
    list(engine.run_until_done())
    path = tmp_path / "talk.ggsq"
    engine.save_session(session, str(path))
    assert companion_path(path).is_file()
    restarted = engine_for(model)
    resumed = restarted.open_session(str(path))
    assert resumed.tokens == session.tokens
    assert restarted.checkpoints.stats.added >= 5
    out = run(restarted, DIVERGING)
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == fresh(model, DIVERGING)


def test_a_save_without_checkpoints_writes_no_companion_and_removes_a_stale_one(tmp_path):
    model = make_model("toy")
    path, _ = saved_slot(model, tmp_path)
    plain = Engine(Context(model, n_seq_max=2, n_batch=64), prompt_cache=True)  # no prefix cache
    run(plain, seq(3, 10), slot=0)
    plain.slot_save(0, str(path))
    assert not companion_path(path).exists()


# ----------------------------------------------------------------- --cache-dir


def test_the_cache_dir_serves_a_prompt_after_a_restart_reading_rows_lazily(tmp_path, monkeypatch):
    model = make_model("mamba2")
    first = engine_for(model, cache_dir=tmp_path)
    run(first, HISTORY)
    assert first.checkpoints.disk is not None and len(first.checkpoints.disk) >= 6
    reads: list[int] = []
    parse = cache_dir_module.cf.parse_file
    monkeypatch.setattr(
        cache_dir_module.cf, "parse_file", lambda data, **kw: reads.append(1) or parse(data, **kw)
    )
    restarted = engine_for(model, cache_dir=tmp_path)
    assert len(restarted.checkpoints) == 0 and len(restarted.checkpoints.disk) == len(first.checkpoints.disk)
    assert reads == []  # only the headers were read
    out = run(restarted, DIVERGING)
    assert reads == [1]
    assert out.num_cached_tokens == 40 and restarted.checkpoints.stats.disk_restores == 1
    assert out.outputs[0].token_ids == fresh(model, DIVERGING)


def test_a_corrupt_cache_file_is_dropped_with_a_warning_and_never_served(tmp_path, caplog):
    model = make_model("mamba2")
    run(engine_for(model, cache_dir=tmp_path), HISTORY)
    WRITER.flush()  # the files are written in the background
    (folder,) = tmp_path.iterdir()
    by_key = {}
    for f in folder.iterdir():
        with f.open("rb") as fh:
            by_key[len(cf.read_header(fh.read).key_tokens)] = f
    rows40 = bytearray(by_key[40].read_bytes())
    rows40[-20] ^= 0x01  # a row value: only the record's checksum can tell
    by_key[40].write_bytes(bytes(rows40))
    by_key[32].write_bytes(by_key[32].read_bytes()[:-3])  # truncated: seen at the start
    (folder / ".x.rsck.123.tmp").write_bytes(b"half")  # a write that never finished
    with caplog.at_level(logging.WARNING, logger="rsmem.cache_dir"):
        restarted = engine_for(model, cache_dir=tmp_path)
        assert not by_key[32].exists() and not (folder / ".x.rsck.123.tmp").exists()
        out = run(restarted, DIVERGING)
    assert caplog.text.count("dropping") == 2
    assert restarted.checkpoints.disk.stats.corrupt == 2  # (40 is written again, sound, by this request)
    assert out.num_cached_tokens == 24  # 40 failed its checksum, 32 was truncated
    assert out.outputs[0].token_ids == fresh(model, DIVERGING)


def test_cache_files_of_another_model_are_ignored(tmp_path, caplog):
    run(engine_for(make_model("mamba2", seed=3), cache_dir=tmp_path), HISTORY)
    WRITER.flush()
    other = make_model("mamba2", seed=4)
    (theirs,) = tmp_path.iterdir()
    ours_engine = engine_for(other, cache_dir=tmp_path)
    assert ours_engine.checkpoints.disk is not None and len(ours_engine.checkpoints.disk) == 0
    for f in theirs.iterdir():  # even when copied into this model's folder
        (ours_engine.checkpoints.disk.dir / f.name).write_bytes(f.read_bytes())
    with caplog.at_level(logging.WARNING, logger="rsmem.cache_dir"):
        restarted = engine_for(other, cache_dir=tmp_path)
    assert len(restarted.checkpoints.disk) == 0 and "another model" in caplog.text
    out = run(restarted, DIVERGING)
    assert out.num_cached_tokens == 0
    assert out.outputs[0].token_ids == fresh(other, DIVERGING)


def test_the_disk_budget_evicts_files(tmp_path):
    model = make_model("toy")
    first = engine_for(model, cache_dir=tmp_path)
    one_file = len(
        cf.entry_bytes(first.checkpoints.layout, first.checkpoints.fingerprint, [1], _any_ckpt(first))
    )
    engine = engine_for(model, cache_dir=tmp_path / "small", cache_disk_bytes=3 * one_file + 200)
    run(engine, HISTORY)
    disk = engine.checkpoints.disk
    disk.flush()
    files = list(disk.dir.iterdir())
    assert len(files) == len(disk) <= 3 and disk.stats.evictions > 0
    assert sum(f.stat().st_size for f in files) == disk.nbytes <= disk.tree.budget_bytes


def _any_ckpt(engine: Engine):
    run(engine, seq(2, 3))
    ckpt = engine.checkpoints.tree.match(seq(2, 3), touch=False)
    assert ckpt is not None
    return ckpt.payload


def test_entries_waiting_for_the_writer_are_served_and_evictions_wait_behind_writes(tmp_path):
    model = make_model("toy")
    engine = engine_for(model)
    ckpt = _any_ckpt(engine)
    cache = engine.checkpoints
    size = cf.entry_size(cache.layout, 3, ckpt.codec)
    disk = cache_dir_module.DiskCache(tmp_path, cache.layout, cache.fingerprint, budget_bytes=size)
    gate = threading.Event()
    WRITER.submit(gate.wait)  # hold the writer
    try:
        assert disk.put([1, 2, 3], ckpt)
        path = disk.dir / cache_dir_module.entry_name([1, 2, 3])
        assert not path.exists() and disk.load([1, 2, 3]) is ckpt  # served before its file exists
        assert disk.put([4, 5, 6], ckpt)  # evicts [1, 2, 3] (one entry fits), whose write still waits
    finally:
        gate.set()
    disk.flush()
    assert not path.exists() and (disk.dir / cache_dir_module.entry_name([4, 5, 6])).is_file()
    assert len(disk) == 1 and disk.stats.evictions == 1
