"""Hybrid checkpoints on disk (``--cache-dir``): version 2 checkpoint files hold the recurrent rows and the
KV prefix (memory/checkpoint_kv.py); an engine started later over the same folder serves a prompt from
them with the tokens a fresh sequence gives; a corrupt file is dropped, never served; files of a hybrid
and of a recurrent memory do not mix; a saved slot's companion file carries its checkpoints with their
KV rows into a later engine."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.engine import Engine, SamplingParams
from rsmem.engine.kept import companion_path
from rsmem.memory import checkpoint
from rsmem.memory import checkpoint_file as cf

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
GREEDY = SamplingParams.greedy(max_tokens=6)


@pytest.fixture(scope="module", params=["lfm2", "nemotron_h"])
def model(request):
    return rsmem.load_model(FIXTURES / request.param / "model-f32.gguf")


def seq(start: int, n: int) -> list[int]:
    return [(start + 7 * k) % 300 for k in range(n)]


def engine_for(model, n_seq_max: int = 2, **kw) -> Engine:
    ctx = Context(model, n_seq_max=n_seq_max, n_batch=64, n_ubatch=16, n_ctx=512 * n_seq_max)
    return Engine(ctx, **kw)


def run(engine: Engine, prompt, **kw):
    rid = engine.add_request(prompt, GREEDY, **kw)
    return next(o for o in engine.run_until_done() if o.finished and o.request_id == rid)


def _checkpoint(model, codec: str) -> tuple[Context, checkpoint.Checkpoint]:
    ctx = Context(model, n_seq_max=2, n_ctx=512)
    ctx.decode(Batch(seq(5, 30), seq_ids=[[1]] * 30))
    ckpt = checkpoint.take(ctx.memory, 1, codec)
    assert ckpt is not None and ckpt.kv is not None
    return ctx, ckpt


@pytest.mark.parametrize("codec", ["exact", "bf16", "int8"])
def test_a_hybrid_entry_round_trips_with_its_kv_rows(model, codec: str) -> None:
    ctx, ckpt = _checkpoint(model, codec)
    layout = cf.Layout.of(ctx.memory)
    assert layout.kv and layout.version == 2
    fp = cf.model_fingerprint(model, layout)
    data = cf.entry_bytes(layout, fp, seq(5, 30), ckpt)
    assert len(data) == cf.entry_size(layout, 30, codec, len(ckpt.kv.positions))
    ((n, back),) = cf.parse_file(
        data, kind=cf.KIND_ENTRY, layout=layout, fingerprint=fp, key_tokens=seq(5, 30)
    )
    assert n == 30 and back.pos == ckpt.pos and back.kv is not None
    assert back.kv.positions == ckpt.kv.positions == tuple(range(30))
    for a, b in zip((*back.kv.k, *back.kv.v), (*ckpt.kv.k, *ckpt.kv.v), strict=True):
        assert torch.equal(checkpoint._decode(a), checkpoint._decode(b))
    # restoring the parsed checkpoint gives the state the original gives
    fresh = Context(model, n_seq_max=2, n_ctx=512)
    checkpoint.restore(fresh.memory, back, 0)
    checkpoint.restore(ctx.memory, ckpt, 0)
    assert fresh.state_seq_get_data(0) == ctx.state_seq_get_data(0)


def test_corrupt_kv_rows_and_foreign_layouts_are_refused(model) -> None:
    ctx, ckpt = _checkpoint(model, "exact")
    layout = cf.Layout.of(ctx.memory)
    fp = cf.model_fingerprint(model, layout)
    data = bytearray(cf.entry_bytes(layout, fp, seq(5, 30), ckpt))
    kw = dict(kind=cf.KIND_ENTRY, layout=layout, fingerprint=fp, key_tokens=seq(5, 30))
    bad = bytearray(data)
    bad[-8] ^= 0xFF  # inside the last V row: the record's checksum fails
    with pytest.raises(cf.CheckpointFileError, match="checksum"):
        cf.parse_file(bad, **kw)
    with pytest.raises(cf.CheckpointFileError, match=r"truncated|bytes"):
        cf.parse_file(data[:-100], **kw)
    recurrent_only = cf.Layout(layout.state_type, layout.widths)
    with pytest.raises(cf.CheckpointFileError, match="another shape"):
        cf.parse_file(data, **{**kw, "layout": recurrent_only})
    with pytest.raises(ValueError, match="KV rows"):  # a hybrid checkpoint does not fit a recurrent layout
        cf.entry_bytes(recurrent_only, fp, seq(5, 30), ckpt)
    assert struct.unpack_from("<I", data, 4)[0] == 2  # version 2: a reader of version 1 files refuses it


def test_a_later_engine_serves_a_prompt_from_the_cache_dir(model, tmp_path: Path) -> None:
    prompt = seq(3, 40) + seq(60, 6)
    want = run(engine_for(model, n_seq_max=1), prompt).outputs[0].token_ids
    first = engine_for(model, cache_bytes=1 << 24, cache_dir=tmp_path / "cache")
    assert first.checkpoints is not None and first.checkpoints.disk is not None
    assert run(first, prompt).outputs[0].token_ids == want
    first.checkpoints.disk.flush()
    files = list((tmp_path / "cache").rglob("*.rsck"))
    assert files and all(struct.unpack_from("<I", f.read_bytes(), 4)[0] == 2 for f in files)

    later = engine_for(model, cache_bytes=1 << 24, cache_dir=tmp_path / "cache")
    again = run(later, prompt)
    assert again.num_cached_tokens == len(prompt) - 1  # a regenerate: the whole prompt but one token
    assert again.outputs[0].token_ids == want
    assert later.snapshot().disk_restores >= 1


def test_a_corrupt_file_is_dropped_not_served(model, tmp_path: Path) -> None:
    prompt = seq(9, 30)
    want = run(engine_for(model, n_seq_max=1), prompt).outputs[0].token_ids
    first = engine_for(model, cache_bytes=1 << 24, cache_dir=tmp_path / "cache")
    run(first, prompt)
    assert first.checkpoints is not None and first.checkpoints.disk is not None
    first.checkpoints.disk.flush()
    for f in (tmp_path / "cache").rglob("*.rsck"):
        raw = bytearray(f.read_bytes())
        raw[-10] ^= 0x55
        f.write_bytes(bytes(raw))
    later = engine_for(model, cache_bytes=1 << 24, cache_dir=tmp_path / "cache")
    out = run(later, prompt)
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == want
    assert later.checkpoints is not None and later.checkpoints.disk is not None
    assert later.checkpoints.disk.stats.corrupt >= 1


def test_a_saved_hybrid_slot_carries_its_checkpoints(model, tmp_path: Path) -> None:
    history = seq(1, 44)
    diverging = history[:42] + seq(9, 5)  # leaves the history at 42: the checkpoints at 8..40 are along it
    engine = engine_for(model, cache_bytes=1 << 24, checkpoint_interval=8, prompt_cache=True)
    run(engine, history, slot=0)
    path = tmp_path / "s.ggsq"
    n_tokens, _ = engine.slot_save(0, str(path))
    assert companion_path(path).is_file()
    restarted = engine_for(model, cache_bytes=1 << 24, checkpoint_interval=8, prompt_cache=True)
    assert restarted.slot_restore(0, str(path)) == n_tokens
    assert restarted.checkpoints is not None and len(restarted.checkpoints) >= 5
    out = run(restarted, diverging)
    assert out.num_cached_tokens == 40
    assert out.outputs[0].token_ids == run(engine_for(model), diverging).outputs[0].token_ids


def test_a_hybrid_companion_without_kv_rows_is_not_used(model, tmp_path: Path) -> None:
    engine = engine_for(model, cache_bytes=1 << 24, checkpoint_interval=8, prompt_cache=True)
    run(engine, seq(1, 44), slot=0)
    path = tmp_path / "s.ggsq"
    engine.slot_save(0, str(path))
    raw = bytearray(companion_path(path).read_bytes())
    raw[4:8] = struct.pack("<I", 1)  # claims a recurrent (version 1) file: its layout no longer matches
    companion_path(path).write_bytes(bytes(raw))
    restarted = engine_for(model, cache_bytes=1 << 24, checkpoint_interval=8, prompt_cache=True)
    restarted.slot_restore(0, str(path))
    assert restarted.checkpoints is not None and len(restarted.checkpoints) == 1  # the restored state only
