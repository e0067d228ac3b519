"""The hybrids' C++ decode step (kernels/csrc/hybrid_step.cpp through models/hybrid/native.py) gives the
eager path's logits, states and keys and values: one sequence and several, after prompts of different
lengths, with a fork (cells shared between sequences), per-sequence and unified KV streams, with and without
output rows; its first call's check catches an op that differs; a bad operand is an error before anything
is written; a float16 KV cache and a rollback's replay take the Python attention."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.kernels.build import native_ops
from rsmem.models.hybrid import native as hybrid_native
from rsmem.models.step import compiled

pytestmark = pytest.mark.compiled

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
needs_cxx = pytest.mark.skipif(not compiled.has_cxx_compiler(), reason="the kernels need a C++ compiler")
ARCHS = ["lfm2", "nemotron_h"]


def _run(
    model, unified: bool, kv_dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Prompts of 20 and 5 tokens, a fork, one sequence alone, then three and two together; the logits of
    each step, and the memory's recurrent rows and keys and values after."""
    ctx = rsmem.Context(model, n_seq_max=4, n_ctx=1024, kv_unified=unified, kv_dtype=kv_dtype)
    out = []
    ctx.decode(rsmem.Batch(list(range(1, 21)) + list(range(40, 45)), seq_ids=[[0]] * 20 + [[1]] * 5))
    ctx.memory.seq_cp(1, 2, -1, -1)
    for k in range(4):
        ctx.decode(rsmem.Batch([7 + k], seq_ids=[[0]]))
        out.append(ctx.logits.clone())
    for k in range(3):
        ctx.decode(rsmem.Batch([11 + k, 20 + k, 30 + k], seq_ids=[[0], [1], [2]], logits=[True] * 3))
        out.append(ctx.logits.clone())
    ctx.decode(rsmem.Batch([3], seq_ids=[[2]], logits=[False]))  # no output row
    out.append(ctx.logits.clone())
    ctx.decode(rsmem.Batch([5, 6], seq_ids=[[2], [1]], logits=[True] * 2))
    out.append(ctx.logits.clone())
    memory = ctx.memory
    rows = [t for t in (*memory.recurrent.r_l, *memory.recurrent.s_l) if t is not None]
    return out, [*rows, *memory.kv.k_l.values(), *memory.kv.v_l.values()]


def _counting(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count the op's calls (HybridNativeStep.__call__)."""
    calls: list[int] = []
    original = hybrid_native.HybridNativeStep.__call__

    def counted(self, x, *args):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return original(self, x, *args)

    monkeypatch.setattr(hybrid_native.HybridNativeStep, "__call__", counted)
    return calls


def _run_many(model, n: int) -> list[torch.Tensor]:
    """``n`` sequences with prompts of 3 to 7 tokens, then two steps of all of them together: the logits of
    each step, then the memory's recurrent rows and keys and values."""
    ctx = rsmem.Context(model, n_seq_max=n, n_ctx=16 * n, kv_unified=True)
    for s in range(n):
        prompt = [(5 * s + t) % 60 + 1 for t in range(3 + s % 5)]
        ctx.decode(rsmem.Batch(prompt, seq_ids=[[s]] * len(prompt), logits=[False] * len(prompt)))
    out = []
    for k in range(2):
        toks = [(s + 3 * k) % 60 + 1 for s in range(n)]
        ctx.decode(rsmem.Batch(toks, seq_ids=[[s] for s in range(n)], logits=[True] * n))
        out.append(ctx.logits.clone())
    memory = ctx.memory
    rows = [t for t in (*memory.recurrent.r_l, *memory.recurrent.s_l) if t is not None]
    return [*out, *rows, *memory.kv.k_l.values(), *memory.kv.v_l.values()]


@needs_cxx
@pytest.mark.parametrize("arch", ARCHS)
def test_many_sequences_take_the_packed_matrices(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """From PACKED_FROM_ROWS sequences the op takes the float32 matrices as their oneDNN packed twins, its
    first call of that form checked too; the eager path's results."""
    n = hybrid_native.PACKED_FROM_ROWS + 1
    model = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    want = _run_many(model, n)
    native_ops()
    calls = _counting(monkeypatch)
    model.set_compile(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        got = _run_many(model, n)
    assert model._native is not None and model._native.checked == {True} and model._native.failed is None
    assert calls == [n, n]  # the first on copies for the check, the second for real
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


@needs_cxx
@pytest.mark.parametrize("unified", [False, True])
@pytest.mark.parametrize("arch", ARCHS)
def test_native_step_matches_eager(arch: str, unified: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    eager, eager_state = _run(model, unified)
    native_ops()
    calls = _counting(monkeypatch)
    model.set_compile(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed check would fall back silently
        got, got_state = _run(model, unified)
    assert model._native is not None and model._native.checked == {False} and model._native.failed is None
    # the first step ran the op on copies for its check; every later step through it, widths 1, 3, 2
    assert calls == [1, 1, 1, 1, 3, 3, 3, 1, 2]
    assert [t.shape for t in got] == [t.shape for t in eager]
    assert got[-2].shape[0] == 0
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert len(got_state) == len(eager_state)
    for a, b in zip(got_state, eager_state, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=0, atol=2e-5)


@needs_cxx
@pytest.mark.parametrize("arch", ARCHS)
def test_check_catches_a_differing_op(arch: str) -> None:
    """A block given a wrong scale (attention) passes the op's own checks but not the comparison: a
    warning, the chains' logits (the step right), and the chains from then on."""
    model = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    eager, _ = _run(model, False)
    native_ops()
    model.set_compile(True)
    step = model._native_step()
    step._scales = [s * 3 for s in step._scales]
    with pytest.warns(RuntimeWarning, match="hybrid decode step is not used: its .* differ"):
        got, _ = _run(model, False)
    assert step.failed is not None and not step.usable(1)
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)


def _one_step_operands(arch: str):
    """A model, a context after a prompt, and the op's arguments for one more token of sequence 0, taken
    from HybridNativeStep.decode's call."""
    model = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=True)
    native_ops()
    ctx = rsmem.Context(model, n_ctx=256)
    ctx.decode(rsmem.Batch(list(range(1, 9))))
    ctx.decode(rsmem.Batch([9], pos=[8]))  # checked
    seen = {}
    original = hybrid_native.HybridNativeStep.__call__

    def grab(self, x, fills, cells, rope):  # type: ignore[no-untyped-def]
        seen.update(step=self, x=x.clone(), fills=fills, cells=cells, rope=rope)
        return original(self, x, fills, cells, rope)

    hybrid_native.HybridNativeStep.__call__ = grab  # type: ignore[method-assign]
    try:
        ctx.decode(rsmem.Batch([10], pos=[9]))
    finally:
        hybrid_native.HybridNativeStep.__call__ = original  # type: ignore[method-assign]
    return model, ctx, seen


@needs_cxx
@pytest.mark.parametrize("arch", ARCHS)
def test_bad_operands_are_errors_before_any_write(arch: str) -> None:
    model, ctx, seen = _one_step_operands(arch)
    step, x, fills, (store, index, valid), rope = (seen[k] for k in ("step", "x", "fills", "cells", "rope"))
    before = {il: tuple(t.clone() for t in ts) for il, ts in fills.items()}
    bad_cells = {
        "store row": (store + 10_000, index, valid),
        "index": (store, index.masked_fill(valid, 10_000), valid),
        "valid": (store, index, valid[:, :0]),
    }
    for what, cells in bad_cells.items():
        with pytest.raises(ValueError, match=what):
            step(x, fills, cells, rope)
    layer = next(il for il in fills if il not in step.attention_layers)
    bad_fills = dict(fills)
    bad_fills[layer] = (fills[layer][0][..., :1], *fills[layer][1:])  # a window of the wrong size
    with pytest.raises(ValueError, match="window"):
        step(x, bad_fills, (store, index, valid), rope)
    with pytest.raises(ValueError, match="x must be"):
        step(x.double(), fills, (store, index, valid), rope)
    for il, ts in fills.items():
        for a, b in zip(ts, before[il], strict=True):
            assert torch.equal(a, b), f"layer {il} was written by a call that failed"


@needs_cxx
def test_float16_kv_takes_the_python_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    model = rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf", compile=False)
    eager, _ = _run(model, True, torch.float16)
    calls = _counting(monkeypatch)
    model.set_compile(True)
    got, _ = _run(model, True, torch.float16)
    assert calls == []
    for a, b in zip(got, eager, strict=True):  # the chains' float16 products round apart from eager's
        torch.testing.assert_close(a, b, rtol=0, atol=2.5e-4)  # two float16 steps at 0.2
