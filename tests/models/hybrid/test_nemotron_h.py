"""Nemotron-H from llama.cpp's GGUF (tests/fixtures/llamacpp/nemotron_h): Mamba-2, attention and MLP-only
layers, their memory, forks and partial removals. Parity with llama.cpp: test_hybrid_parity.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.memory.hybrid import HybridMemory

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "nemotron_h"
PROMPT = json.loads((FIXTURES / "fixture.json").read_text())["prompt"]


@pytest.fixture(scope="module")
def model():
    return rsmem.load_model(FIXTURES / "model-f32.gguf")


def test_layers_and_memory(model) -> None:
    assert model.arch == "nemotron_h"
    assert model.config.kinds == "M*M-"
    assert dict(model.kv_layers) == {1: (32, 32)}
    assert model.n_embd_r == 3 * (128 + 2 * 16) and model.n_embd_s == 16 * 128
    mem = Context(model, n_seq_max=2, n_ctx=512).memory
    assert isinstance(mem, HybridMemory)
    present = [t is not None for t in mem.recurrent.r_l]
    assert present == [True, False, True, False]  # attention and MLP layers hold no recurrent rows
    assert list(mem.kv.k_l) == [1]


@pytest.mark.parametrize("unified", [False, True])
def test_fork_and_partial_removal(model, unified: bool) -> None:
    ctx = Context(model, n_seq_max=2, n_ctx=512, kv_unified=unified)
    mem = ctx.memory
    assert isinstance(mem, HybridMemory)
    ctx.decode(Batch(PROMPT))
    assert mem.seq_rm(0, 6, -1) is False  # the Mamba-2 state cannot be cut
    mem.seq_cp(0, 1)
    ctx.decode(Batch([11, 12], seq_ids=[[1]] * 2, logits=[True, True]))
    got = ctx.logits.clone()
    fresh = Context(model, n_seq_max=1, n_ctx=512)
    fresh.decode(Batch([*PROMPT, 11, 12], logits=[False] * len(PROMPT) + [True, True]))
    torch.testing.assert_close(got, fresh.logits, atol=2e-5, rtol=0)
    assert mem.seq_pos_max(0) == len(PROMPT) - 1 and mem.seq_pos_max(1) == len(PROMPT) + 1
    mem.check_invariants()


def test_sizes(model) -> None:
    mem = Context(model, n_seq_max=2, n_ctx=512).memory
    assert isinstance(mem, HybridMemory)
    assert mem.kv_bytes_per_token() == 2 * 32 * 4  # one attention layer, K and V of 2 heads x 16, f32
    assert mem.state_bytes_per_seq() == 2 * (3 * 160 + 16 * 128) * 4  # two Mamba-2 layers
    assert mem.total_size() == 2 * 256 * 2 * 32 * 4 + 2 * mem.state_bytes_per_seq()
