"""LFM2 and Nemotron-H on the hybrid memory against llama.cpp's own outputs (tests/fixtures/llamacpp/{lfm2,
nemotron_h}, see ../shared/fixtures/README.md): logits of the prompt and of the continuation, token by token
and with two sequences in one batch (KV unified or one stream per sequence), and the sequence state
llama.cpp wrote: rsmem writes the same bytes (values up to float rounding), loads llama.cpp's blob into
another sequence, writes it back bit for bit and continues with llama.cpp's continuation logits."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.memory import state_io

ROOT = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
ARCHS = ["lfm2", "nemotron_h"]
ATOL = 1e-5  # llama.cpp f32 vs rsmem; both are within 5e-6 of transformers here
_models: dict[str, object] = {}


@pytest.fixture(params=ARCHS)
def arch(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def fx(arch: str) -> dict:
    return json.loads((ROOT / arch / "fixture.json").read_text())


@pytest.fixture
def model(arch: str):
    if arch not in _models:
        _models[arch] = rsmem.load_model(ROOT / arch / "model-f32.gguf")
    return _models[arch]


def _npy(arch: str, name: str) -> torch.Tensor:
    return torch.from_numpy(np.load(ROOT / arch / name))


def _ctx(model, **kw) -> Context:
    kw.setdefault("n_seq_max", 2)
    kw.setdefault("n_ctx", 512)
    return Context(model, **kw)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    assert err < ATOL, err


def test_prompt_and_continuation_match_llamacpp(model, arch: str, fx: dict) -> None:
    PROMPT, CONT = fx["prompt"], fx["continuation"]
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    _close(ctx.logits, _npy(arch, "logits-prompt-f32.npy"))
    ctx.decode(Batch(CONT, logits=[True] * len(CONT)))
    _close(ctx.logits, _npy(arch, "logits-continuation-f32.npy"))


def test_token_by_token_matches_the_whole_prompt(model, arch: str, fx: dict) -> None:
    PROMPT, CONT = fx["prompt"], fx["continuation"]
    ctx = _ctx(model)
    rows = []
    for t in PROMPT + CONT:
        ctx.decode(Batch([t]))
        rows.append(ctx.logits[0].clone())
    _close(torch.stack(rows[: len(PROMPT)]), _npy(arch, "logits-prompt-f32.npy"))
    _close(torch.stack(rows[len(PROMPT) :]), _npy(arch, "logits-continuation-f32.npy"))


@pytest.mark.parametrize("unified", [False, True])
def test_two_sequences_in_one_batch(model, arch: str, fx: dict, unified: bool) -> None:
    PROMPT, CONT = fx["prompt"], fx["continuation"]
    prompt, cont = _npy(arch, "logits-prompt-f32.npy"), _npy(arch, "logits-continuation-f32.npy")
    ctx = _ctx(model, n_seq_max=3, n_ctx=768, kv_unified=unified)
    ctx.decode(Batch.from_sequences({0: PROMPT, 2: PROMPT[:7]}, all_logits=True))
    _close(ctx.logits[:12], prompt)
    _close(ctx.logits[12:], prompt[:7])
    ctx.decode(Batch.from_sequences({2: PROMPT[7:], 0: CONT}, all_logits=True))
    _close(ctx.logits[:5], prompt[7:])
    _close(ctx.logits[5:], cont)
    ctx.memory.check_invariants()


def _data_regions(fx: dict) -> list[tuple[int, int]]:
    """(offset, bytes) of the float data in llama.cpp's blob, from the fixture's layout."""
    layout = fx["state_blob"]["layout"]
    stream = layout["attention"]["streams"][0]
    entries = stream["k"] + stream["v"] + layout["recurrent"]["r"] + layout["recurrent"]["s"]
    return [(e["offset"], e["bytes"]) for e in entries]


def _assert_like_llamacpp(ours_bytes: bytes, theirs_bytes: bytes, fx: dict) -> None:
    """Every header, count, position and seq id byte equal; K, V and recurrent values up to rounding."""
    ours = np.frombuffer(ours_bytes, dtype=np.uint8)
    theirs = np.frombuffer(theirs_bytes, dtype=np.uint8)
    assert ours.size == theirs.size == fx["state_blob"]["part_sizes"]["total"]
    meta = np.ones(ours.size, dtype=bool)
    for off, n in _data_regions(fx):
        meta[off : off + n] = False
        if n:
            a, b = ours[off : off + n].view(np.float32), theirs[off : off + n].view(np.float32)
            assert np.abs(a - b).max() < ATOL
    assert (ours[meta] == theirs[meta]).all()


def test_state_blob_is_llamacpps_layout(model, arch: str, fx: dict) -> None:
    PROMPT = fx["prompt"]
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    theirs = (ROOT / arch / "state-seq0-f32.bin").read_bytes()
    _assert_like_llamacpp(state_io.seq_blob(ctx.memory, 0), theirs, fx)
    tokens = struct.pack(f"<III{len(PROMPT)}i", 0x67677371, 3, len(PROMPT), *PROMPT)
    ggsq = state_io.seq_file_bytes(ctx.memory, 0, PROMPT)
    assert ggsq[: len(tokens)] == tokens and ggsq[len(tokens) :] == state_io.seq_blob(ctx.memory, 0)[8:]


def test_rollback_matches_llamacpp(model, arch: str, fx: dict) -> None:
    """The fixture's n_rs_seq case: prompt as one batch, cut its last 2 positions, decode 2 other tokens."""
    PROMPT = fx["prompt"]
    ctx = _ctx(model, n_rs_seq=3)
    ctx.decode(Batch(PROMPT))
    assert ctx.memory.seq_rm(0, 10, -1) is True
    assert ctx.memory.seq_pos_max(0) == 9
    ctx.decode(Batch([21, 22], logits=[True, True]))
    _close(ctx.logits, _npy(arch, "rollback-logits.npy"))
    _assert_like_llamacpp(
        state_io.seq_blob(ctx.memory, 0), (ROOT / arch / "rollback-state-seq0.bin").read_bytes(), fx
    )
    assert ctx.memory.seq_rm(0, 5, -1) is False  # deeper than the window: refused


def test_rollback_after_one_token_decodes_is_exact(model, arch: str, fx: dict) -> None:
    """Where llama.cpp b11312 keeps a stale state (a one-token decode after the batch, and a cut of the
    whole last batch), the cut equals a fresh sequence fed the kept tokens."""
    PROMPT = fx["prompt"]
    ctx = _ctx(model, n_rs_seq=3)
    ctx.decode(Batch(PROMPT))
    ctx.decode(Batch([30]))
    ctx.decode(Batch([31]))
    assert ctx.memory.seq_rm(0, 12, -1) is True  # both one-token batches
    ctx.decode(Batch([21], logits=[True]))
    fresh = _ctx(model)
    fresh.decode(Batch([*PROMPT, 21]))
    _close(ctx.logits, fresh.logits)
    ctx.memory.check_invariants()


@pytest.mark.parametrize("dest", [0, 1])
def test_llamacpp_blob_restores_and_continues(model, arch: str, fx: dict, dest: int) -> None:
    PROMPT, CONT = fx["prompt"], fx["continuation"]
    blob = (ROOT / arch / "state-seq0-f32.bin").read_bytes()
    ctx = _ctx(model)
    assert state_io.load_seq_blob(ctx.memory, blob, dest) == len(blob)
    ctx.memory.check_invariants()
    assert ctx.memory.seq_pos_max(dest) == len(PROMPT) - 1
    again = _ctx(model)  # written back and read again as sequence 0: bit for bit llama.cpp's blob
    state_io.load_seq_blob(again.memory, state_io.seq_blob(ctx.memory, dest), 0)
    assert state_io.seq_blob(again.memory, 0) == blob
    ctx.decode(Batch(CONT, seq_ids=[[dest]] * len(CONT), logits=[True] * len(CONT)))
    _close(ctx.logits, _npy(arch, "logits-continuation-f32.npy"))


def test_sequence_file_round_trip_into_another_sequence(model, arch: str, fx: dict) -> None:
    PROMPT, CONT = fx["prompt"], fx["continuation"]
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    data = state_io.seq_file_bytes(ctx.memory, 0, PROMPT)
    other = _ctx(model)
    assert state_io.load_seq_file_bytes(other.memory, data, 1, n_vocab=model.n_vocab) == PROMPT
    other.decode(Batch(CONT, seq_ids=[[1]] * 3, logits=[True] * 3))
    _close(other.logits, _npy(arch, "logits-continuation-f32.npy"))


def test_session_file_round_trip(model, arch: str, fx: dict) -> None:
    PROMPT, CONT = fx["prompt"], fx["continuation"]
    ctx = _ctx(model, n_seq_max=2)
    ctx.decode(Batch.from_sequences({0: PROMPT, 1: PROMPT[:5]}))
    data = state_io.session_file_bytes(ctx.memory, arch, PROMPT)
    other = _ctx(model, n_seq_max=2)
    assert state_io.load_session_file_bytes(other.memory, data, arch) == PROMPT
    assert other.memory.state_write(-1) == ctx.memory.state_write(-1)
    other.decode(Batch(CONT, logits=[True] * 3))
    _close(other.logits, _npy(arch, "logits-continuation-f32.npy"))


@pytest.mark.parametrize("n_ubatch", [1, 5])
def test_chunked_prefill_matches_transformers(model, arch: str, fx: dict, n_ubatch: int) -> None:
    """The prompt in micro-batches of ``n_ubatch`` tokens, against transformers' full forward (fp32)."""
    PROMPT, CONT = fx["prompt"], fx["continuation"]
    ctx = _ctx(model, n_ubatch=n_ubatch)
    ctx.decode(Batch(PROMPT + CONT, logits=[True] * (len(PROMPT) + len(CONT))))
    want = torch.cat([_npy(arch, "ref-logits-prompt.npy"), _npy(arch, "ref-logits-continuation.npy")])
    _close(ctx.logits, want)


@pytest.mark.parametrize("unified", [False, True])
def test_four_sequences_in_one_batch_match_transformers(model, arch: str, fx: dict, unified: bool) -> None:
    """Four prefixes of the prompt in one batch (equal split: micro-batches of one token per sequence at
    the end), each against transformers' logits of the same prefix."""
    PROMPT = fx["prompt"]
    want = _npy(arch, "ref-logits-prompt.npy")
    lengths = {0: 12, 1: 3, 2: 9, 3: 6}
    ctx = _ctx(model, n_seq_max=4, n_ctx=1024, kv_unified=unified)
    ctx.decode(Batch.from_sequences({s: PROMPT[:n] for s, n in lengths.items()}, all_logits=True))
    row = 0
    for n in lengths.values():
        _close(ctx.logits[row : row + n], want[:n])
        row += n
    ctx.memory.check_invariants()
