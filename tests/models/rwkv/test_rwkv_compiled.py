"""The compiled decode steps of RWKV-7 and RWKV-6 against the eager models: one sequence (ops.wkv_fused)
and several (ops.wkv_many, with a dynamic batch) under torch.compile give the same logits and the same
state rows, token by token; half-precision state rows decode eagerly. Each with the C++ step that takes the
compiled steps' place where it runs (RSMEM_NATIVE_STEP=1) and without it."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem import Batch, Context
from rsmem.models.step.compiled import has_cxx_compiler

pytestmark = pytest.mark.compiled

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "rwkv"
PROMPT = list(range(1, 12))


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
@pytest.mark.parametrize("native", ["1", "0"])  # the C++ step (test_rwkv_native_step.py), the compiled one
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_compiled_step_matches_eager(arch: str, native: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSMEM_NATIVE_STEP", native)
    eager = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    compiled = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=True)
    assert not eager.compile_decode and compiled.compile_decode
    contexts = [Context(m, n_seq_max=2) for m in (eager, compiled)]
    for ctx in contexts:
        ctx.decode(Batch(PROMPT))
    for tok in (5, 261, 17, 299):
        outs = []
        for ctx in contexts:
            ctx.decode(Batch([tok]))
            outs.append(ctx.get_logits(-1))
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
    blobs = [ctx.state_seq_get_data(0) for ctx in contexts]
    assert len(blobs[0]) == len(blobs[1]) and blobs[0][:28] == blobs[1][:28]
    offset = 28
    for row_bytes in [2 * 128 * 4] * 2 + [128 * 64 * 4] * 2:  # r rows of both layers, then s rows
        assert blobs[0][offset : offset + 12] == blobs[1][offset : offset + 12]
        a, b = (
            torch.frombuffer(bytearray(x[offset + 12 : offset + 12 + row_bytes]), dtype=torch.float32)
            for x in blobs
        )
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)
        assert a.abs().max() > 0
        offset += 12 + row_bytes
    assert offset == len(blobs[0])
    # half-precision rows: the compiled step declines, the eager path decodes (the prefill's compiled
    # within-chunk part rounds differently: the same logits within half precision's rounding of the rows)
    halves = [Context(m, state_dtype=torch.float16) for m in (eager, compiled)]
    for ctx in halves:
        ctx.decode(Batch(PROMPT))
        ctx.decode(Batch([5]))
    torch.testing.assert_close(halves[1].get_logits(-1), halves[0].get_logits(-1), rtol=0, atol=2e-4)


def state_rows(blob: bytes, n_embd: int = 128, head_size: int = 64, n_layer: int = 2) -> list[torch.Tensor]:
    """The float32 rows of a one-sequence state blob (r rows of every layer, then s rows)."""
    rows, offset = [], 28
    for row_bytes in [2 * n_embd * 4] * n_layer + [n_embd * head_size * 4] * n_layer:
        data = bytearray(blob[offset + 12 : offset + 12 + row_bytes])
        rows.append(torch.frombuffer(data, dtype=torch.float32))
        offset += 12 + row_bytes
    assert offset == len(blob)
    return rows


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
@pytest.mark.parametrize("native", ["1", "0"])
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_compiled_batched_decode_matches_eager(
    arch: str, native: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several sequences (one compiled call a step, the packed products inside it, a dynamic batch): logits
    and state rows as the eager path, at two batch sizes, with only some sequences asking for logits."""
    monkeypatch.setenv("RSMEM_NATIVE_STEP", native)
    eager = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    compiled = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=True)
    contexts = [Context(m, n_seq_max=5) for m in (eager, compiled)]
    prompts = [[t + s for t in PROMPT] for s in range(5)]  # different per sequence, so the rows differ
    for ctx in contexts:
        ctx.decode(Batch([t for p in prompts for t in p], seq_ids=[[s] for s in range(5) for _ in PROMPT]))
    for step, n in enumerate((5, 3, 5)):
        toks = [(17 * s + 31 * step) % 299 + 1 for s in range(n)]
        wanted = [s % 2 == 0 for s in range(n)]
        outs = []
        for ctx in contexts:
            with warnings.catch_warnings():  # a compile that fails warns and decodes eagerly: not here
                warnings.simplefilter("error", RuntimeWarning)
                ctx.decode(Batch(toks, seq_ids=[[s] for s in range(n)], logits=wanted))
            outs.append(ctx.logits.clone())
        assert outs[0].shape[0] == sum(wanted) and outs[0].abs().max() > 0
        torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
    for s in range(5):
        rows = [state_rows(ctx.state_seq_get_data(s)) for ctx in contexts]
        for a, b in zip(*rows, strict=True):
            assert a.abs().max() > 0
            torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
@pytest.mark.parametrize("arch", ["rwkv7", "rwkv6"])
def test_compiled_prefill_matches_eager(arch: str) -> None:
    """Prefill with the WKV kernel's within-chunk part compiled (every chunk padded to full length): two
    sequences of different lengths in one batch (one shorter than a chunk, one over several), then a short
    prompt alone; logits and state rows as the eager path's."""
    eager = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    compiled = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=True)
    long_prompt = [(7 * i) % 299 + 1 for i in range(70)]
    contexts = [Context(m, n_seq_max=3) for m in (eager, compiled)]
    outs = []
    for ctx in contexts:
        with warnings.catch_warnings():  # a compile that fails warns and runs eagerly: not here
            warnings.simplefilter("error", RuntimeWarning)
            ctx.decode(
                Batch(
                    PROMPT[:5] + long_prompt,
                    seq_ids=[[0]] * 5 + [[1]] * len(long_prompt),
                    logits=[i in (4, 74) for i in range(75)],
                )
            )
            first = [ctx.get_logits(4).clone(), ctx.get_logits(74).clone()]
            ctx.decode(Batch(PROMPT[:3], seq_ids=[[2]] * 3))
            outs.append(torch.stack([*first, ctx.get_logits(-1)]))
    assert outs[0].abs().max() > 0
    torch.testing.assert_close(outs[1], outs[0], rtol=0, atol=1e-5)
    for s in range(3):
        rows = [state_rows(ctx.state_seq_get_data(s)) for ctx in contexts]
        for a, b in zip(*rows, strict=True):
            assert a.abs().max() > 0
            assert (b - a).abs().max() <= 1e-5 * a.abs().max()  # WKV states reach ~10 here
