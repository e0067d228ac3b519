"""The hybrids' compiled decode steps (models/step/hybrid_fused.py through models/step/compiled.py) give the
eager path's logits and states: one sequence and several (a compiled chain per stretch between attention
layers, attention's KV part eager: models/hybrid/chains.py; several sequences' chains with the packed
products and a dynamic batch), after a prompt, with a fork, with and without output rows. The C++ step
that takes their place where it runs is tests/models/hybrid/test_hybrid_native.py's."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.models.step import compiled
from rsmem.models.step.compiled import CompiledStep

pytestmark = pytest.mark.compiled

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp"
needs_cxx = pytest.mark.skipif(not compiled.has_cxx_compiler(), reason="inductor needs a C++ compiler")


def _run(model, compile_decode: bool) -> list[torch.Tensor]:
    """Prefill two sequences, fork one, decode one sequence alone then three together."""
    model.set_compile(compile_decode)
    ctx = rsmem.Context(model, n_seq_max=4, n_ctx=1024)
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
    ctx.decode(rsmem.Batch([5, 6], seq_ids=[[2], [1]], logits=[True] * 2))  # after the states moved
    out.append(ctx.logits.clone())
    return out


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("arch", ["lfm2", "nemotron_h"])
def test_compiled_decode_matches_eager(arch: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")  # the chains (the C++ step: test_hybrid_native.py)
    model = rsmem.load_model(FIXTURES / arch / "model-f32.gguf", compile=False)
    eager = _run(model, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure would fall back silently
        got = _run(model, True)
    assert model.compile_decode
    chains = model._chains.steps  # the one-sequence chains: one per distinct stretch of layers
    many = model._chains_many.steps  # several sequences' (widths 3 and 2 share each)
    steps = chains + many + [v for v in vars(model).values() if isinstance(v, CompiledStep)]
    assert len(chains) >= 2 and len(many) == len(chains)
    assert all(s._checked and s.failed is None for s in steps)
    assert [t.shape for t in got] == [t.shape for t in eager]
    assert got[-2].shape[0] == 0  # the step without an output row gives none
    for a, b in zip(got, eager, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=2e-5)
    assert model.warm_up() > 0  # runs the compiled steps on a scratch memory


def test_auto_policy_leaves_tiny_hybrids_eager() -> None:
    model = rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf", compile="auto")
    assert not model.compile_decode
    assert model.warm_up() == 0.0


def test_load_model_passes_compile_and_dtype_to_hybrids(monkeypatch: pytest.MonkeyPatch) -> None:
    """load_model(compile=, dtype=) reach a hybrid model (they were dropped: RSMEM_COMPILE decided)."""
    monkeypatch.setenv("RSMEM_COMPILE", "1")
    model = rsmem.load_model(FIXTURES / "nemotron_h" / "model-f32.gguf", compile=False)
    assert not model.compile_decode
    bf16 = rsmem.load_model(FIXTURES / "lfm2" / "model-f32.gguf", dtype=torch.bfloat16, compile=False)
    assert bf16.lm_head.dtype == torch.bfloat16
    ctx = rsmem.Context(bf16, n_ctx=256)
    ctx.decode(rsmem.Batch([1, 2, 3]))
    assert torch.isfinite(ctx.logits).all()
