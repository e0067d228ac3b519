"""LFM2 on the hybrid memory against llama.cpp's own outputs (tests/fixtures/llamacpp/lfm2, see
../shared/fixtures/README.md): logits of the prompt and of the continuation, token by token and with two
sequences in one batch (KV unified or one stream per sequence), and the sequence state llama.cpp wrote:
rsmem writes the same bytes (values up to float rounding), loads llama.cpp's blob into another sequence,
writes it back bit for bit and continues with llama.cpp's continuation logits."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.errors import StateFormatError
from rsmem.memory import hybrid_state
from rsmem.memory.hybrid import HybridMemory

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "lfm2"
FX = json.loads((FIXTURES / "fixture.json").read_text())
PROMPT, CONT = FX["prompt"], FX["continuation"]
ATOL = 1e-5  # llama.cpp f32 vs rsmem; both are within 5e-6 of transformers here


def _npy(name: str) -> torch.Tensor:
    return torch.from_numpy(np.load(FIXTURES / name))


@pytest.fixture(scope="module")
def model():
    return rsmem.load_model(FIXTURES / "model-f32.gguf")


def _ctx(model, **kw) -> Context:
    kw.setdefault("n_seq_max", 2)
    kw.setdefault("n_ctx", 512)
    return Context(model, **kw)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item()
    assert err < ATOL, err


def test_loads_as_a_hybrid(model) -> None:
    assert model.arch == "lfm2"
    assert dict(model.kv_layers) == {1: (32, 32), 3: (32, 32)}
    assert [model.is_recurrent_layer(il) for il in range(4)] == [True, False, True, False]
    assert model.n_embd_r == 2 * 64 and model.n_embd_s == 0
    assert isinstance(_ctx(model).memory, HybridMemory)


def test_prompt_and_continuation_match_llamacpp(model) -> None:
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    _close(ctx.logits, _npy("logits-prompt-f32.npy"))
    ctx.decode(Batch(CONT, logits=[True] * len(CONT)))
    _close(ctx.logits, _npy("logits-continuation-f32.npy"))


def test_token_by_token_matches_the_whole_prompt(model) -> None:
    ctx = _ctx(model)
    rows = []
    for t in PROMPT + CONT:
        ctx.decode(Batch([t]))
        rows.append(ctx.logits[0].clone())
    _close(torch.stack(rows[: len(PROMPT)]), _npy("logits-prompt-f32.npy"))
    _close(torch.stack(rows[len(PROMPT) :]), _npy("logits-continuation-f32.npy"))


@pytest.mark.parametrize("unified", [False, True])
def test_two_sequences_in_one_batch(model, unified: bool) -> None:
    prompt, cont = _npy("logits-prompt-f32.npy"), _npy("logits-continuation-f32.npy")
    ctx = _ctx(model, n_seq_max=3, n_ctx=768, kv_unified=unified)
    ctx.decode(Batch.from_sequences({0: PROMPT, 2: PROMPT[:7]}, all_logits=True))
    _close(ctx.logits[:12], prompt)
    _close(ctx.logits[12:], prompt[:7])
    ctx.decode(Batch.from_sequences({2: PROMPT[7:], 0: CONT}, all_logits=True))
    _close(ctx.logits[:5], prompt[7:])
    _close(ctx.logits[5:], cont)
    ctx.memory.check_invariants()


def _data_regions() -> list[tuple[int, int]]:
    """(offset, bytes) of the float data in llama.cpp's blob, from the fixture's layout."""
    layout = FX["state_blob"]["layout"]
    stream = layout["attention"]["streams"][0]
    entries = stream["k"] + stream["v"] + layout["recurrent"]["r"] + layout["recurrent"]["s"]
    return [(e["offset"], e["bytes"]) for e in entries]


def test_state_blob_is_llamacpps_layout(model) -> None:
    """Every header, count, position and seq id byte equal; K, V and conv values equal up to rounding."""
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    ours = np.frombuffer(hybrid_state.seq_blob(ctx.memory, 0), dtype=np.uint8)
    theirs = np.frombuffer((FIXTURES / "state-seq0-f32.bin").read_bytes(), dtype=np.uint8)
    assert ours.size == theirs.size == FX["state_blob"]["part_sizes"]["total"]
    meta = np.ones(ours.size, dtype=bool)
    for off, n in _data_regions():
        meta[off : off + n] = False
        if n:
            a, b = ours[off : off + n].view(np.float32), theirs[off : off + n].view(np.float32)
            assert np.abs(a - b).max() < ATOL
    assert (ours[meta] == theirs[meta]).all()
    tokens = struct.pack(f"<III{len(PROMPT)}i", 0x67677371, 3, len(PROMPT), *PROMPT)
    ggsq = hybrid_state.seq_file_bytes(ctx.memory, 0, PROMPT)
    assert ggsq[: len(tokens)] == tokens and len(ggsq) == len(tokens) + theirs.size - 8


@pytest.mark.parametrize("dest", [0, 1])
def test_llamacpp_blob_restores_and_continues(model, dest: int) -> None:
    blob = (FIXTURES / "state-seq0-f32.bin").read_bytes()
    ctx = _ctx(model)
    assert hybrid_state.load_seq_blob(ctx.memory, blob, dest) == len(blob)
    ctx.memory.check_invariants()
    assert ctx.memory.seq_pos_max(dest) == len(PROMPT) - 1
    again = _ctx(model)  # written back and read again as sequence 0: bit for bit llama.cpp's blob
    hybrid_state.load_seq_blob(again.memory, hybrid_state.seq_blob(ctx.memory, dest), 0)
    assert hybrid_state.seq_blob(again.memory, 0) == blob
    ctx.decode(Batch(CONT, seq_ids=[[dest]] * len(CONT), logits=[True] * len(CONT)))
    _close(ctx.logits, _npy("logits-continuation-f32.npy"))


def test_sequence_file_round_trip_into_another_sequence(model) -> None:
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT))
    data = hybrid_state.seq_file_bytes(ctx.memory, 0, PROMPT)
    other = _ctx(model)
    assert hybrid_state.load_seq_file_bytes(other.memory, data, 1, n_vocab=model.n_vocab) == PROMPT
    other.decode(Batch(CONT, seq_ids=[[1]] * 3, logits=[True] * 3))
    _close(other.logits, _npy("logits-continuation-f32.npy"))


def test_session_file_round_trip(model) -> None:
    ctx = _ctx(model, n_seq_max=2)
    ctx.decode(Batch.from_sequences({0: PROMPT, 1: PROMPT[:5]}))
    data = hybrid_state.session_file_bytes(ctx.memory, "lfm2", PROMPT)
    other = _ctx(model, n_seq_max=2)
    assert hybrid_state.load_session_file_bytes(other.memory, data, "lfm2") == PROMPT
    assert other.memory.state_write(-1) == ctx.memory.state_write(-1)
    other.decode(Batch(CONT, logits=[True] * 3))
    _close(other.logits, _npy("logits-continuation-f32.npy"))


def test_corrupt_states_are_refused_with_the_memory_untouched(model) -> None:
    blob = bytearray((FIXTURES / "state-seq0-f32.bin").read_bytes())
    ctx = _ctx(model)
    ctx.decode(Batch(PROMPT[:4], seq_ids=[[1]] * 4))
    before = ctx.memory.state_write(-1)
    nan = bytearray(blob)
    nan[200:204] = struct.pack("<f", float("nan"))  # a K value
    bad = (
        [blob[:n] for n in (4, 12, 40, 170, 1000, 3270, 6360, 6370, 6400, len(blob) - 1)]
        + [
            blob + b"\0",
            blob[:8] + struct.pack("<I", 1) + blob[12:],  # one KV stream: this cache has two
            blob[:20] + struct.pack("<I", 2) + blob[24:],  # a cell listing two seq ids
            blob[:164] + struct.pack("<I", 3) + blob[168:],  # three attention layers
            blob[:168] + struct.pack("<i", 1) + blob[172:],  # K said to be F16
            blob[:6380] + struct.pack("<I", 5) + blob[6384:],  # five model layers
            nan,
        ]
    )
    for data in bad:
        with pytest.raises(StateFormatError):
            hybrid_state.load_seq_blob(ctx.memory, bytes(data), 0)
        assert ctx.memory.state_write(-1) == before
        ctx.memory.check_invariants()
