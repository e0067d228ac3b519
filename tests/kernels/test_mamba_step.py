"""Mamba's one-token decode step in C++ (kernels/csrc/mamba_step.cpp through models/ops/native_step.py):
the model's decode against its layer-by-layer forward (float32), the op against the compiled step's
function run eagerly on llama.cpp's quantized files, and bad operands rejected before any state is
written."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.kernels.build import native_ops
from rsmem.models.mamba import MambaConfig
from rsmem.models.random_init import random_mamba

QUANT = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "quant"


@pytest.fixture(scope="module")
def ops():
    ops = native_ops()
    assert ops is not None, "the C++ kernels must build here"
    return ops


def _model(seed: int = 4):
    return random_mamba(MambaConfig(d_model=64, n_layer=3, n_vocab=80, d_state=16, dt_rank=5), seed=seed)


def _decode(model, steps: int = 5) -> list[torch.Tensor]:
    ctx = rsmem.Context(model, n_seq_max=2)
    ctx.decode(rsmem.Batch(list(range(1, 10)), seq_ids=[[0]] * 9))
    out = []
    for k in range(steps):
        ctx.decode(rsmem.Batch([(5 * k + 3) % 80], seq_ids=[[0]]))
        out.append(ctx.logits.clone())
    return out + [t.clone() for t in (*ctx.memory.r_l, *ctx.memory.s_l)]


@pytest.mark.parametrize("d_state", [16, 12])  # whole AVX-512 vectors, and a scalar tail
def test_model_decode_matches_the_layer_by_layer_forward(
    ops, monkeypatch: pytest.MonkeyPatch, d_state: int
) -> None:
    model = random_mamba(MambaConfig(d_model=64, n_layer=3, n_vocab=80, d_state=d_state, dt_rank=5), seed=4)
    model.set_compile(False)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")
    want = _decode(model)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed check would fall back with a warning
        got = _decode(model)
    assert model._native is not None and model._native._checked and model._native.failed is None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def _one_step_args(model):
    head, weights = model.one_sequence_args()
    gen = torch.Generator().manual_seed(1)
    states = [
        model.state_views(
            torch.randn(1, model.n_embd_r, generator=gen),
            torch.randn(1, model.n_embd_s, generator=gen) * 0.1,
            1,
        )
        for _ in range(model.n_layer)
    ]
    flat = [t for w, v in zip(weights, states, strict=True) for t in (*w, *v)]
    return torch.randn(1, model.config.d_model, generator=gen), head, flat


def _copy_states(flat: list, n: int) -> list:
    return [t.clone() if i % n >= n - 2 else t for i, t in enumerate(flat)]


@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"])
def test_quantized_step_matches_its_twin(ops, qtype: str) -> None:
    """The products are the same kernels; the activations' int8 rounding can differ in a last bit."""
    model = rsmem.load_model(QUANT / "mamba" / f"model-{qtype}.gguf", compile="0")
    step = model._native
    assert step is not None
    x, head, flat = _one_step_args(model)
    n = step.n_fields
    mine, theirs = _copy_states(flat, n), _copy_states(flat, n)
    eps = model.config.eps
    got = step(x, model.norm_f, head, eps, *mine)
    want = step.twin(x, model.norm_f, head, eps, *theirs)
    assert float((got - want).abs().max()) <= 1e-3 * float(want.abs().max())
    for a, b in zip(mine, theirs, strict=True):
        if a is not b:
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3 * float(b.abs().max()))


def test_step_rejects_a_bad_layer_before_writing(ops) -> None:
    model = _model()
    x, head, flat = _one_step_args(model)
    n = model._native.n_fields
    flat[-1] = flat[-1][:, :, :-1].contiguous()  # the last layer's h, one state short a channel
    before = [t.clone() for i, t in enumerate(flat) if i % n >= n - 2]
    with pytest.raises(ValueError, match="mamba step: h must be"):
        model._native(x, model.norm_f, head, model.config.eps, *flat)
    after = [t for i, t in enumerate(flat) if i % n >= n - 2]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
