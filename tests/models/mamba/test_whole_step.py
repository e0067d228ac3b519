"""The whole compiled decode step of several sequences (ops.fused.token_step_many): every layer and the head
in one compiled call, batch size dynamic, against the eager layer-by-layer forward."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.models.mamba.mamba1 import MambaConfig
from rsmem.models.mamba.mamba2 import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba, random_mamba2
from rsmem.models.step import compiled, fused
from rsmem.models.step.packed import packing_enabled
from rsmem.models.step.small_rows import kernel_ops

pytestmark = pytest.mark.compiled

needs_cxx = pytest.mark.skipif(not compiled.has_cxx_compiler(), reason="inductor needs a C++ compiler")
QUANT = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "quant"


@pytest.fixture(autouse=True)
def compiled_steps_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are of the compiled batched step: the C++ step (which takes up to 16 sequences where the
    kernels are loaded) has its own tests (tests/kernels/test_mamba*_step.py)."""
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")


def _model(arch: str, seed: int = 7):
    if arch == "mamba":
        return random_mamba(MambaConfig(d_model=48, n_layer=3, n_vocab=96, d_state=8, dt_rank=4), seed=seed)
    cfg = Mamba2Config(d_model=48, n_layer=3, n_vocab=96, d_state=8, n_head=6, n_group=2, chunk_size=4)
    return random_mamba2(cfg, seed=seed)


def _steps(model, compile_decode: bool) -> list[torch.Tensor]:
    """Prefill five sequences, then one-token steps of widths 2, 3, 5 and 4, one of them with a row that
    asks for no logits (a one-token replay); every step's logits, then every layer's state rows."""
    model.set_compile(compile_decode)
    ctx = rsmem.Context(model, n_seq_max=5)
    ctx.decode(rsmem.Batch(list(range(1, 16)), seq_ids=[[s] for s in range(5) for _ in range(3)]))
    out = []
    for k, width in enumerate((2, 3, 5, 4, 3, 2)):
        logits = [True] * width
        if k == 3:
            logits[1] = False
        tokens = [(7 * k + 3 * s) % 96 for s in range(width)]
        ctx.decode(rsmem.Batch(tokens, seq_ids=[[s] for s in range(width)], logits=logits))
        out.append(ctx.logits.clone())
    return out + [t.clone() for t in (*ctx.memory.r_l, *ctx.memory.s_l)]


def _assert_close(got: list[torch.Tensor], want: list[torch.Tensor], atol: float) -> None:
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=atol)


@pytest.mark.slow
@needs_cxx
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_whole_step_matches_eager(arch: str) -> None:
    model = _model(arch)
    eager = _steps(model, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure would fall back silently
        got = _steps(model, True)
    step = model._token_step_many
    assert step._checked and step.failed is None
    _assert_close(got, eager, 2e-5)
    _, head, weights = model._step_args[True]
    operands = [head, *(w for layer in weights for w in layer if not isinstance(w, torch.Tensor))]
    # with oneDNN the products of several rows take the packed twins (rsmem::packed_linear), through the C++
    # few-row kernel up to 16 rows when the kernels are loaded (rsmem_native::rows_linear)
    kind = fused.SmallRows if kernel_ops() is not None else fused.Packed
    assert operands and all(isinstance(w, kind) for w in operands) == packing_enabled()


@needs_cxx
def test_whole_step_marks_the_batch_dynamic_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """The first compile marks the batch dimension dynamic; later widths reuse it unmarked and never
    recompile (marking each of 2 * n_layer + 1 arguments at every step cost ~0.1 ms on the embedded model)."""
    model = _model("mamba2", seed=3)
    model.set_compile(True)
    ctx = rsmem.Context(model, n_seq_max=6)
    ctx.decode(rsmem.Batch([1, 2], seq_ids=[[0], [1]], logits=[True, True]))
    marks: list[int] = []
    real = torch._dynamo.mark_dynamic
    monkeypatch.setattr(torch._dynamo, "mark_dynamic", lambda t, d, **kw: marks.append(d) or real(t, d, **kw))
    with torch.compiler.set_stance("fail_on_recompile"):
        for width in (2, 3, 6, 4):
            ctx.decode(rsmem.Batch([5] * width, seq_ids=[[s] for s in range(width)], logits=[True] * width))
    assert marks == []


def test_whole_step_falls_back_to_its_eager_function(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where compiling fails the same function runs eagerly (packed products included), state untouched
    by the failed attempt: the same logits and states as the model's eager forward."""

    def broken_compile(fn, **kwargs):
        def run(*args):
            raise RuntimeError("no C++ compiler")

        return run

    want = _steps(_model("mamba2"), False)
    monkeypatch.setattr(compiled.torch, "compile", broken_compile)
    model = _model("mamba2")
    with pytest.warns(RuntimeWarning, match="no C.. compiler"):
        got = _steps(model, True)
    assert model._token_step_many.failed is not None
    _assert_close(got, want, 2e-5)


@pytest.mark.slow
@needs_cxx
@pytest.mark.skipif(not (QUANT / "mamba2" / "model-q8_0.gguf").is_file(), reason="quantized fixture missing")
@pytest.mark.parametrize("kind", ["q8_0", "q4_k_m"])
def test_whole_step_with_quantized_matrices(kind: str) -> None:
    """Matrices kept in their GGUF blocks (QuantMatrix) multiply through their kernel inside the step."""
    outs = []
    for compile_decode in (False, True):
        model = rsmem.load_model(QUANT / "mamba2" / f"model-{kind}.gguf", compile=compile_decode)
        ctx = rsmem.Context(model, n_seq_max=3)
        ctx.decode(rsmem.Batch([1, 2, 3, 4, 5, 6], seq_ids=[[0], [0], [1], [1], [2], [2]]))
        steps = []
        for k in range(3):
            ctx.decode(rsmem.Batch([7 + k, 9 + k, 11 + k], seq_ids=[[0], [1], [2]], logits=[True] * 3))
            steps.append(ctx.logits.clone())
        outs.append(torch.cat(steps))
        if compile_decode:
            assert model._token_step_many._checked and model._token_step_many.failed is None
    scale = float(outs[0].abs().max())
    assert float((outs[1] - outs[0]).abs().max()) < 1e-5 * max(scale, 1.0)
