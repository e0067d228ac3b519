"""RWKV-7 and RWKV-6 against llama.cpp b11312 itself (tests/fixtures/llamacpp/rwkv, made by
``scripts/make_rwkv_fixtures.py``): the GGUF rsmem's converter wrote loads in llama.cpp, and rsmem gives
llama.cpp's logits (prompt, continuation, a fork), llama.cpp's tokens for the texts, and llama.cpp's sequence
state blob: same bytes in every header field, values within float error; llama.cpp's blob restored into rsmem
continues as llama.cpp did."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import rsmem
from rsmem import Batch, Context

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "rwkv"


def close(got: torch.Tensor, want: np.ndarray, rel: float = 1e-4) -> None:
    ref = torch.from_numpy(want)
    err = (got - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max error {err:.3g}, scale {ref.abs().max().item():.3g}"


@pytest.fixture(scope="module", params=["rwkv7", "rwkv6"])
def fixture(request) -> tuple[Path, dict, object]:
    folder = FIXTURES / request.param
    meta = json.loads((folder / "fixture.json").read_text())
    return folder, meta, rsmem.load_model(folder / "model-f32.gguf")


def test_tokens_match_llamacpp(fixture) -> None:
    _, meta, model = fixture
    for text, tokens in zip(meta["texts"], meta["tokens"], strict=True):
        assert model.tokenizer.encode(text).ids == tokens


def test_prompt_and_continuation(fixture) -> None:
    folder, meta, model = fixture
    prompt = meta["prompt"]
    ctx = Context(model, n_seq_max=2)
    ctx.decode(Batch(prompt, logits=[True] * len(prompt)))
    close(ctx.logits, np.load(folder / "logits-prompt.npy"))
    want = np.load(folder / "logits-continuation.npy")
    for i, tok in enumerate(meta["continuation"]):
        ctx.decode(Batch([tok]))
        close(ctx.get_logits(-1), want[i])
    ctx.memory.seq_cp(0, 1, -1, -1)
    fork = meta["fork"]
    ctx.decode(Batch(fork["0"] + fork["1"], seq_ids=[[0], [0], [1], [1]], logits=[False, True, False, True]))
    close(ctx.logits, np.load(folder / "logits-fork.npy"))


def test_state_blob_is_llamacpps(fixture) -> None:
    folder, meta, model = fixture
    theirs = (folder / "state-seq0.bin").read_bytes()
    ctx = Context(model, n_seq_max=2)
    ctx.decode(Batch(meta["prompt"]))
    ours = ctx.state_seq_get_data(0)
    assert len(ours) == len(theirs) == meta["state_blob_bytes"]
    # headers byte for byte: everything but the float rows (each row: i32 type, u64 bytes, then the data)
    n_layer, row_r, row_s = 2, 2 * 128 * 4, 128 * 64 * 4
    offset, header = 28, [(0, 28)]
    values = []
    for row in [row_r] * n_layer + [row_s] * n_layer:
        header.append((offset, offset + 12))
        values.append((offset + 12, offset + 12 + row))
        offset += 12 + row
    assert offset == len(theirs)
    for a, b in header:
        assert ours[a:b] == theirs[a:b]
    for a, b in values:
        got = torch.frombuffer(bytearray(ours[a:b]), dtype=torch.float32)
        want = np.frombuffer(theirs[a:b], dtype=np.float32).copy()
        close(got, want, rel=1e-5)


def test_llamacpp_state_restored_and_continued(fixture) -> None:
    folder, meta, model = fixture
    ctx = Context(model, n_seq_max=2)
    assert ctx.state_seq_set_data((folder / "state-seq0.bin").read_bytes(), 1) > 0
    assert ctx.memory.seq_pos_max(1) == len(meta["prompt"]) - 1
    want = np.load(folder / "logits-continuation.npy")
    for i, tok in enumerate(meta["continuation"]):
        ctx.decode(Batch([tok], seq_ids=[[1]]))
        close(ctx.get_logits(-1), want[i])
