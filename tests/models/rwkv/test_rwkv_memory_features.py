"""The recurrent memory's features on RWKV models, unchanged above the model: half-precision state rows,
exact rollback of a kept state (``n_rs_seq``), and checkpoints captured inside a micro-batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.memory import checkpoint

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "rwkv"
PROMPT = list(range(1, 30))


@pytest.fixture(scope="module", params=["rwkv7", "rwkv6"])
def model(request):
    return rsmem.load_model(FIXTURES / request.param / "model-f32.gguf")


@pytest.fixture(scope="module")
def full(model) -> torch.Tensor:
    ctx = Context(model)
    ctx.decode(Batch(PROMPT, logits=[True] * len(PROMPT)))
    return ctx.logits


@pytest.mark.parametrize(("dtype", "rel"), [(torch.float16, 1e-3), (torch.bfloat16, 1e-2)])
def test_half_precision_state_rows(model, full, dtype: torch.dtype, rel: float) -> None:
    ctx = Context(model, state_dtype=dtype)
    ctx.decode(Batch(PROMPT[:10]))
    ctx.decode(Batch(PROMPT[10:], logits=[True] * 19))
    err = (ctx.logits - full[10:]).abs().max()
    assert 0 < err <= rel * full.abs().max()  # rounded, and close


def test_rollback_of_a_kept_state_is_exact(model, full) -> None:
    ctx = Context(model, n_seq_max=2, n_rs_seq=4)
    ctx.decode(Batch(PROMPT[:20]))
    assert ctx.memory.seq_rm(0, 17, -1)
    ctx.decode(Batch(PROMPT[17:], logits=[True] * 12))
    torch.testing.assert_close(ctx.logits, full[17:], rtol=0, atol=1e-5)


def test_captured_checkpoints_continue_as_a_fresh_sequence(model, full) -> None:
    ctx = Context(model, n_seq_max=2)
    ctx.decode(Batch(PROMPT), capture={0: [5, 12]})
    caps = ctx.captured()
    assert sorted(caps) == [(0, 5), (0, 12)]
    for n in (5, 12):
        checkpoint.restore(ctx.memory, caps[(0, n)], 1)
        ctx.decode(Batch(PROMPT[n : n + 3], seq_ids=[[1]] * 3, logits=[True] * 3))
        torch.testing.assert_close(ctx.logits, full[n : n + 3], rtol=0, atol=1e-5)
