"""LFM2 from llama.cpp's GGUF (tests/fixtures/llamacpp/lfm2): its layers and memory, and corrupt hybrid
states refused with the memory untouched. Parity with llama.cpp: test_hybrid_parity.py."""

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
from rsmem.memory import state_io
from rsmem.memory.hybrid import HybridMemory

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "lfm2"
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
            state_io.load_seq_blob(ctx.memory, bytes(data), 0)
        assert ctx.memory.state_write(-1) == before
        ctx.memory.check_invariants()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_kv_cache(model, dtype: torch.dtype) -> None:
    """K/V kept in f16/bf16: logits near llama.cpp's f32 ones; the state says so (ggml type 1 / 30) and
    loads into an f32 cache, and llama.cpp's f32 blob into a half one."""
    ctx = _ctx(model, kv_dtype=dtype)
    mem = ctx.memory
    assert isinstance(mem, HybridMemory) and mem.kv.k_l[1].dtype == dtype
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    want = torch.from_numpy(np.load(FIXTURES / "logits-prompt-f32.npy"))
    err = (ctx.logits - want).abs().max().item()
    assert err < (2e-3 if dtype == torch.float16 else 2e-2), err
    blob = state_io.seq_blob(mem, 0)
    k_type = struct.unpack_from("<iQ", blob, 168)
    assert k_type == ({torch.float16: 1, torch.bfloat16: 30}[dtype], 32 * 2)
    f32 = _ctx(model)
    state_io.load_seq_blob(f32.memory, blob, 1)
    assert f32.memory.kv.k_l[1][1, :12].equal(mem.kv.k_l[1][0, :12].float())
    state_io.load_seq_blob(mem, (FIXTURES / "state-seq0-f32.bin").read_bytes(), 1)
    ctx.decode(Batch(CONT, seq_ids=[[1]] * 3, logits=[True] * 3))
    cont = torch.from_numpy(np.load(FIXTURES / "logits-continuation-f32.npy"))
    assert (ctx.logits - cont).abs().max().item() < (2e-3 if dtype == torch.float16 else 2e-2)


def test_state_of_a_single_token_round_trips(model) -> None:
    """One cell: V transposed is a [n_embd_v, 1] view (writing it raised before)."""
    ctx = _ctx(model)
    ctx.decode(Batch([PROMPT[0]]))
    blob = state_io.seq_blob(ctx.memory, 0)
    other = _ctx(model)
    state_io.load_seq_blob(other.memory, blob, 1)
    assert other.memory.kv.v_l[1][1, 0].equal(ctx.memory.kv.v_l[1][0, 0])
    assert state_io.seq_blob(other.memory, 1)[8:] != b"" and other.memory.seq_pos_max(1) == 0
