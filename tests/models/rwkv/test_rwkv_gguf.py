"""RWKV-7 (and RWKV-6) through GGUF as llama.cpp lays it out: the file loads to the same logits, its World
tokenizer is read, sequence state files round-trip in llama.cpp's format, and ``rsmem generate -m`` runs it;
RWKV-6's rescale_every_n_layers (weights divided by the converter, residual halved) keeps the logits."""

from __future__ import annotations

import dataclasses
import os
import struct
import subprocess
import sys

import pytest
import torch

import rsmem
from helpers.rwkv_reference import random_rwkv6, random_rwkv7, world_vocab, write_rwkv_gguf
from rsmem import Batch, Context
from rsmem.loaders.rwkv.build import build_rwkv, rwkv7_from_blink
from rsmem.loaders.rwkv.rwkv6 import rwkv6_from_blink
from rsmem.loaders.tensors import ModelTensors

PROMPT = [72, 102, 109, 109, 112, 33, 120, 112, 115, 109, 101, 257, 258, 290]


@pytest.fixture(scope="module")
def blink():
    return rwkv7_from_blink(random_rwkv7(128, 2, 300, seed=4))


@pytest.fixture(scope="module")
def gguf_path(blink, tmp_path_factory):
    path = tmp_path_factory.mktemp("rwkv7gguf") / "rwkv7.gguf"
    write_rwkv_gguf(path, "rwkv7", blink[0], blink[1], world_vocab())
    return path


def test_gguf_loads_to_the_same_logits(blink, gguf_path) -> None:
    direct = build_rwkv(ModelTensors(arch="rwkv7", config=blink[0], tensors=blink[1]))
    loaded = rsmem.load_model(gguf_path)
    assert loaded.arch == "rwkv7"
    assert loaded.config == dataclasses.replace(blink[0], eps=loaded.config.eps)  # eps is stored as f32
    assert loaded.config.eps == pytest.approx(1e-5)
    assert (loaded.n_embd_r, loaded.n_embd_s) == (2 * 128, 128 * 64)
    outs = []
    for m in (direct, loaded):
        ctx = Context(m)
        ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
        outs.append(ctx.logits)
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-6)


def test_tokenizer_from_gguf(gguf_path) -> None:
    tok = rsmem.load_model(gguf_path).tokenizer
    assert tok is not None and tok.get_vocab_size() == 300
    ids = tok.encode("Hello, world\n", add_special_tokens=False).ids
    assert all(0 < i < 300 for i in ids)
    assert tok.decode(ids) == "Hello, world\n"


def test_state_file_round_trip(gguf_path, tmp_path) -> None:
    model = rsmem.load_model(gguf_path)
    ctx = Context(model, n_seq_max=2)
    ctx.decode(Batch(PROMPT))
    path = tmp_path / "s.ggsq"
    ctx.state_seq_save_file(path, 0, PROMPT)
    data = path.read_bytes()
    magic, version, n_tokens = struct.unpack_from("<III", data, 0)
    assert (magic, n_tokens) == (0x67677371, len(PROMPT))
    assert list(struct.unpack_from(f"<{n_tokens}i", data, 12)) == PROMPT
    # payload: one cell, its pos, no seq ids, s_trans 0, 2 layers; r rows of 2*n_embd floats first
    cells, pos, n_ids, s_trans, n_layer = struct.unpack_from("<IiIII", data, 12 + 4 * n_tokens)
    assert (cells, pos, n_ids, s_trans, n_layer) == (1, len(PROMPT) - 1, 0, 0, 2)
    r_type, r_bytes = struct.unpack_from("<iQ", data, 12 + 4 * n_tokens + 20)
    assert (r_type, r_bytes) == (0, 2 * 128 * 4)
    fresh = Context(model, n_seq_max=2)
    assert fresh.state_seq_load_file(path, 1) == PROMPT
    assert fresh.state_seq_get_data(1)[8:] == ctx.state_seq_get_data(0)[8:]  # after magic and seq id
    ctx.decode(Batch([5, 6], logits=[False, True]))
    fresh.decode(Batch([5, 6], seq_ids=[[1], [1]], logits=[False, True]))
    torch.testing.assert_close(fresh.logits, ctx.logits, rtol=0, atol=0)


@pytest.mark.subprocess
def test_generate_command_runs_an_rwkv7_gguf(gguf_path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "rsmem.cli", "generate", "-m", str(gguf_path), "-p", "Hello", "-n", "6",
         "--temp", "0", "--ignore-eos"],
        capture_output=True, text=True, timeout=120, env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("Hello") and len(r.stdout) > len("Hello")
    assert "tok/s" in r.stderr


def rwkv6_gguf(tmp_path, rescale: int):
    """A random RWKV-6 as llama.cpp's converter writes it with ``rescale_every_n_layers``: the time-mix output
    and channel-mix value matrices of layer b divided by 2^(b // rescale)."""
    config, tensors = rwkv6_from_blink(random_rwkv6(128, 3, 300, seed=6))
    # a tiny layer-norm eps: the norms are then scale-invariant, and the rescaled model equals the plain one
    config = dataclasses.replace(config, rescale_every_n_layers=rescale, eps=1e-10)
    if rescale:
        for b in range(config.n_layer):
            for kind in ("time_mix_output", "channel_mix_value"):
                tensors[f"blk.{b}.{kind}.weight"] = tensors[f"blk.{b}.{kind}.weight"] / 2 ** (b // rescale)
    path = tmp_path / f"rwkv6-{rescale}.gguf"
    write_rwkv_gguf(path, "rwkv6", config, tensors, world_vocab())
    return path


def test_rwkv6_gguf_and_rescaled_layers(tmp_path) -> None:
    outs = []
    for rescale in (0, 1):
        model = rsmem.load_model(rwkv6_gguf(tmp_path, rescale))
        assert model.arch == "rwkv6" and model.config.rescale_every_n_layers == rescale
        assert model.tokenizer is not None
        ctx = Context(model)
        ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
        outs.append(ctx.logits)
    err = (outs[1] - outs[0]).abs().max().item()
    assert err <= 1e-5 * outs[0].abs().max().item()


def test_bf16_matrices(gguf_path, tmp_path) -> None:
    """``load_model(dtype=bfloat16)`` (``--bf16``) keeps the big matrices and the head in bf16, the rest
    float32; logits stay near the float32 model's."""
    outs = []
    for path, dtype in (
        (gguf_path, torch.float32),
        (gguf_path, torch.bfloat16),
        (rwkv6_gguf(tmp_path, 0), None),
    ):
        model = rsmem.load_model(path, dtype=dtype or torch.bfloat16)
        ly = model.layers[0]
        assert ly.key.dtype == model.lm_head.dtype == (dtype or torch.bfloat16)
        assert ly.attn_norm.dtype == torch.float32
        ctx = Context(model)
        ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
        assert ctx.logits.dtype == torch.float32 and torch.isfinite(ctx.logits).all()
        outs.append(ctx.logits)
    assert (outs[1] - outs[0]).abs().max() <= 0.05 * outs[0].abs().max()
    assert (outs[1] - outs[0]).abs().max() > 0  # bf16 did round something
