"""ARWKV-7 and QRWKV-6 (llama.cpp's ``arwkv7``, ``rwkv6qwen2``) against llama.cpp b11312 itself: the test
builds the random GGUF of ``rwkv_variants.py`` (the same bytes llama.cpp ran, checked by sha256) and rsmem
gives llama.cpp's logits for a prompt, tokens one by one, and a forked pair in one batch, and its state
blob; ARWKV-7 with and without the optional gate and WKV output norm, QRWKV-6 with two key/value heads
and with one shared by both heads plus biases (fixtures: ``tests/fixtures/llamacpp/rwkv/arwkv7*``,
``rwkv6qwen2*``)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import rsmem
from helpers.rwkv_variants import N_EMBD, N_LAYER, random_arwkv7_gguf, random_rwkv6qwen2_gguf, sha256
from rsmem import Batch, Context
from rsmem.cli import main

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "rwkv"


def close(got: torch.Tensor, want: np.ndarray) -> None:
    want_t = torch.from_numpy(want)
    assert want_t.abs().max() > 0
    torch.testing.assert_close(got, want_t, rtol=0, atol=2e-4 * float(want_t.abs().max()))


BUILDS = {
    "arwkv7": lambda p: random_arwkv7_gguf(p, gated=True, seed=3),
    "arwkv7-nogate": lambda p: random_arwkv7_gguf(p, gated=False, seed=3),
    "rwkv6qwen2": lambda p: random_rwkv6qwen2_gguf(p, gqa=False, seed=4),
    "rwkv6qwen2-gqa": lambda p: random_rwkv6qwen2_gguf(p, gqa=True, seed=4),
}


@pytest.mark.parametrize("name", list(BUILDS))
def test_variant_matches_llamacpp(name: str, tmp_path: Path) -> None:
    folder = FIXTURES / name
    spec = json.loads((folder / "fixture.json").read_text())
    path = BUILDS[name](tmp_path / "model.gguf")
    assert sha256(path) == spec["gguf_sha256"], "the GGUF built here differs from the one llama.cpp ran"
    model = rsmem.load_model(path)
    assert model.arch == name.split("-")[0] and model.n_embd_r == N_EMBD and not model.compile_decode
    if name.startswith("arwkv7"):
        assert (model.layers[0].g1 is not None) == (name == "arwkv7")
    else:
        assert model.config.kv_heads == (1 if name.endswith("gqa") else 2)
        assert (model.layers[0].key_b is not None) == name.endswith("gqa")
    ctx = Context(model, n_seq_max=2)
    prompt = spec["prompt"]
    ctx.decode(Batch(prompt, logits=[True] * len(prompt)))
    close(ctx.logits, np.load(folder / "logits-prompt.npy"))
    blob, want_blob = ctx.state_seq_get_data(0), (folder / "state-seq0.bin").read_bytes()
    assert len(blob) == len(want_blob)
    # the rows (after the 28-byte header, each row behind 12 bytes): r (n_embd) then s of each layer
    offset = 28
    for row_floats in [N_EMBD] * N_LAYER + [N_EMBD * 64] * N_LAYER:
        assert blob[offset : offset + 12] == want_blob[offset : offset + 12]
        got, want = (
            np.frombuffer(b[offset + 12 : offset + 12 + 4 * row_floats], np.float32)
            for b in (blob, want_blob)
        )
        close(torch.from_numpy(got.copy()), want)
        offset += 12 + 4 * row_floats
    assert offset == len(blob)
    rows = []
    for tok in spec["continuation"]:
        ctx.decode(Batch([tok]))
        rows.append(ctx.get_logits(-1))
    close(torch.stack(rows), np.load(folder / "logits-continuation.npy"))
    ctx.memory.seq_cp(0, 1, -1, -1)
    ctx.decode(Batch(spec["pair"], seq_ids=[[0], [1]], logits=[True, True]))
    close(ctx.logits, np.load(folder / "logits-pair.npy"))


@pytest.mark.parametrize(("name", "layout"), [("arwkv7", "[H, V, K]"), ("rwkv6qwen2-gqa", "[H, K, V]")])
def test_info_describes_variants(name: str, layout: str, tmp_path: Path, capsys) -> None:
    path = BUILDS[name](tmp_path / "model.gguf")
    assert main(["info", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"architecture:    {name.split('-')[0]}" in out
    assert f"r: token shift 1 x {N_EMBD}; s: WKV {layout} = 2 x 64 x 64" in out
    assert f"state per seq:   {N_LAYER * 4 * (N_EMBD + N_EMBD * 64)} bytes" in out
