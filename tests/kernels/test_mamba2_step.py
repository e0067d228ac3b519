"""Mamba-2's one-token decode step in C++ (kernels/csrc/mamba2_step.cpp, models/step/native.py): the
mixer op against its twin (ops.fused.mamba2_mixer_step_), the whole step against the compiled step's
function run eagerly (token_step of mamba2_layer_one_) and against the model's layer-by-layer forward, for
float32 and quantized matrices; bad operands rejected before any state is written; the first call's check
and its fallback."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import rsmem
from helpers.kernel_steps import assert_decode_matches_forward, assert_matches_twin, decode, one_step_args
from rsmem.engine import default_model_path
from rsmem.models.mamba.mamba2 import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba2
from rsmem.models.step.fused import mamba2_mixer_step_
from rsmem.models.step.native import PACKED_FROM_ROWS

pytestmark = pytest.mark.compiled

QUANT = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "quant"


def _mixer_operands(bs: int, h: int, p: int, n: int, g: int, k: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    d_inner = h * p
    c = d_inner + 2 * g * n

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    zxbcdt = r(bs, d_inner + c + h) * 2
    return (zxbcdt, r(bs, c, k - 1), r(c, k), r(c), r(h), -torch.rand(h, generator=gen) * 3, r(h), r(d_inner),
            r(bs, h, p, n))  # fmt: skip


@pytest.mark.parametrize(
    ("bs", "h", "p", "n", "g", "k"), [(1, 24, 64, 128, 1, 4), (3, 8, 16, 32, 2, 4), (2, 4, 8, 16, 4, 3)]
)
def test_mixer_matches_its_twin(ops, bs: int, h: int, p: int, n: int, g: int, k: int) -> None:
    zxbcdt, window, cw, cb, dtb, a, d, nw, state = _mixer_operands(bs, h, p, n, g, k)
    w_ref, h_ref = window.clone(), state.clone()
    want = mamba2_mixer_step_(zxbcdt, w_ref, cw, cb, dtb, a, d, nw, h_ref, g, 1e-5)
    for threads in (1, 2):
        w_got, h_got = window.clone(), state.clone()
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            got = ops.mamba2_mixer_one_(zxbcdt, w_got, cw, cb, dtb, a, d, nw, h_got, g, 1e-5)
        finally:
            torch.set_num_threads(before)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(w_got, w_ref)  # the window moves by copies only
        torch.testing.assert_close(h_got, h_ref, rtol=1e-5, atol=1e-5)


def test_mixer_rejects_a_bad_window_before_writing(ops) -> None:
    zxbcdt, window, cw, cb, dtb, a, d, nw, state = _mixer_operands(1, 4, 8, 16, 2, 4)
    short = window[:, :-1].clone()
    h_before = state.clone()
    with pytest.raises(ValueError, match="window"):
        ops.mamba2_mixer_one_(zxbcdt, short, cw, cb, dtb, a, d, nw, state, 2, 1e-5)
    assert torch.equal(state, h_before)


def _model(seed: int = 5):
    cfg = Mamba2Config(d_model=64, n_layer=3, n_vocab=80, d_state=16, n_head=4, n_group=2, chunk_size=8)
    return random_mamba2(cfg, seed=seed)


# PACKED_FROM_ROWS + 1: the float32 matrices as their oneDNN packed twins
@pytest.mark.parametrize("n_seqs", [1, 4, PACKED_FROM_ROWS + 1])
def test_model_decode_matches_the_layer_by_layer_forward(
    ops, monkeypatch: pytest.MonkeyPatch, n_seqs: int
) -> None:
    model = _model()
    assert_decode_matches_forward(model, monkeypatch, n_seqs)


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"])
def test_quantized_step_matches_its_twin(ops, qtype: str, rows: int) -> None:
    """llama.cpp's tiny quantized Mamba-2 files: the op against the compiled step's function on the same
    states, one token (the products are the same kernel; the activations' int8 rounding can differ in a
    last bit, so the bound is that of the first call's check, and the typical difference is far below)."""
    assert_matches_twin(rsmem.load_model(QUANT / "mamba2" / f"model-{qtype}.gguf", compile="0"), 1e-3, rows)


def test_embedded_model_f16_decode_matches_the_forward(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """The embedded model keeps its F16 matrices 2 bytes a value: widened in registers, float32 sums."""
    model = rsmem.load_model(default_model_path(), compile="0")
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")
    want = decode(model)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "1")
    got = decode(model)
    assert model._native._checked and model._native.failed is None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_step_rejects_a_bad_layer_before_writing(ops) -> None:
    """A wrong state in the last layer: a ValueError naming it, and no layer's state written."""
    model = _model()
    x, head, flat = one_step_args(model)
    n = len(flat) // model.n_layer
    flat[-1] = flat[-1][:, :, :, :-1].contiguous()  # the last layer's h, one value short a row
    before = [t.clone() for i, t in enumerate(flat) if i % n >= n - 2]
    with pytest.raises(ValueError, match="h"):
        model._native(x, model.norm_f, head, model.config.eps, *flat)
    after = [t for i, t in enumerate(flat) if i % n >= n - 2]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_a_failed_check_keeps_the_other_step(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """When the op and its twin disagree at the first call, a warning says so, nothing is written by the
    check, that step takes the twin's results and later ones the layer-by-layer forward."""
    model = _model()
    model.set_compile(False)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")
    want = decode(model)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "1")
    model._native.twin = _shifted(model._native.twin)
    with pytest.warns(RuntimeWarning, match="C\\+\\+ decode step mamba2_step is not used"):
        got = decode(model)
    assert model._native.failed is not None
    # the first step took the twin's (shifted) logits, the later ones the layer-by-layer forward
    torch.testing.assert_close(got[0], want[0] + 1.0, rtol=1e-5, atol=1e-5)
    for a, b in zip(got[1:], want[1:], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _shifted(fn):
    def shifted(*args):
        return fn(*args) + 1.0

    return shifted


def test_native_step_off_by_setting(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")
    step = _model()._native
    assert step is not None and step.ops() is None
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "1")
    assert step.ops() is ops


@pytest.mark.parametrize("qtype", ["q8_0", "q4_k_m"])
def test_quantized_model_passes_its_check(ops, qtype: str) -> None:
    """The first call's check compares one layer of each kind of matrices, so the int8 routes' rounding does
    not compound through the depth into a refusal."""
    model = rsmem.load_model(QUANT / "mamba2" / f"model-{qtype}.gguf", compile="0")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        decode(model, steps=2)
    assert model._native._checked and model._native.failed is None
