"""Mamba's one-token decode step in C++ (kernels/csrc/mamba_step.cpp through models/step/native.py),
for one and several sequences: the model's decode against its layer-by-layer forward (float32), the op
against the compiled step's function run eagerly on llama.cpp's quantized files, and bad operands rejected
before any state is written."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rsmem
from helpers.kernel_steps import (
    assert_decode_matches_forward,
    assert_matches_twin,
    copy_states,
    decode,
    one_step_args,
)
from rsmem.models.mamba.mamba1 import MambaConfig
from rsmem.models.mamba.random_init import random_mamba
from rsmem.models.step.native import PACKED_FROM_ROWS

pytestmark = pytest.mark.compiled

QUANT = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "quant"


def _model(seed: int = 4):
    return random_mamba(MambaConfig(d_model=64, n_layer=3, n_vocab=80, d_state=16, dt_rank=5), seed=seed)


# PACKED_FROM_ROWS + 1: the float32 matrices as their oneDNN packed twins
@pytest.mark.parametrize("n_seqs", [1, 3, PACKED_FROM_ROWS + 1])
@pytest.mark.parametrize("d_state", [16, 12])  # whole AVX-512 vectors, and a scalar tail
def test_model_decode_matches_the_layer_by_layer_forward(
    ops, monkeypatch: pytest.MonkeyPatch, d_state: int, n_seqs: int
) -> None:
    model = random_mamba(MambaConfig(d_model=64, n_layer=3, n_vocab=80, d_state=d_state, dt_rank=5), seed=4)
    assert_decode_matches_forward(model, monkeypatch, n_seqs)


@pytest.mark.parametrize("rows", [1, 5])
@pytest.mark.parametrize("qtype", ["q8_0", "q4_0", "q4_k_m", "q5_k_m", "q6_k"])
def test_quantized_step_matches_its_twin(ops, qtype: str, rows: int) -> None:
    """The products are the same kernels; the activations' int8 rounding can differ in a last bit."""
    model = rsmem.load_model(QUANT / "mamba" / f"model-{qtype}.gguf", compile="0")
    assert_matches_twin(model, 1e-3, rows)


def test_more_sequences_than_the_step_takes_go_the_other_way(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """Beyond MAX_ROWS sequences the op is not called; the decode matches the forward."""
    from rsmem.models.step import native as native_step

    model = _model()
    model.set_compile(False)
    n_seqs = native_step.MAX_ROWS + 1
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")
    want = decode(model, n_seqs=n_seqs)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "1")
    calls: list[int] = []
    original = model._native._run
    monkeypatch.setattr(model._native, "_run", lambda *a: calls.append(a[0].shape[0]) or original(*a))
    got = decode(model, n_seqs=n_seqs)
    assert calls == []
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_step_rejects_a_bad_layer_before_writing(ops) -> None:
    model = _model()
    x, head, flat = one_step_args(model)
    n = model._native.n_fields
    flat[-1] = flat[-1][:, :, :-1].contiguous()  # the last layer's h, one state short a channel
    before = [t.clone() for i, t in enumerate(flat) if i % n >= n - 2]
    with pytest.raises(ValueError, match="mamba step: h must be"):
        model._native(x, model.norm_f, head, model.config.eps, *flat)
    after = [t for i, t in enumerate(flat) if i % n >= n - 2]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


def test_accepts_looks_again_when_a_matrix_or_state_changes(ops) -> None:
    """accepts keeps its verdict on the weights between calls; another matrix object, or a state that is
    not a contiguous float32 tensor, is looked at again."""
    model = _model()
    step = model._native
    x, head, flat = one_step_args(model)
    n = step.n_fields
    assert step.accepts(head, flat) and step.accepts(head, flat)
    m = step.matrices[0]
    swapped = list(flat)
    swapped[m] = torch.zeros(4, 4, dtype=torch.float64)  # a matrix the op does not take
    assert not step.accepts(head, swapped)
    assert step.accepts(head, flat)
    strided = list(flat)
    strided[n - 1] = torch.zeros_like(flat[n - 1]).transpose(-1, -2)  # the first layer's state
    assert not step.accepts(head, strided)
    halved = list(flat)
    halved[n - 2] = flat[n - 2].double()
    assert not step.accepts(head, halved)


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v2", "x86-64-v3"])
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_portable_and_avx2_builds_match(ops, arch: str, march: str) -> None:
    """The steps built without AVX-512 (AVX2, and the scalar loops) against this machine's build."""
    from helpers.kernel_variants import ops_for_march
    from rsmem.models.mamba.mamba2 import Mamba2Config
    from rsmem.models.mamba.random_init import random_mamba2

    if arch == "mamba":
        model = _model()
    else:
        cfg = Mamba2Config(d_model=64, n_layer=2, n_vocab=80, d_state=16, n_head=4, n_group=2)
        model = random_mamba2(cfg, seed=2)
    step = model._native
    x, head, flat = one_step_args(model, 0.1)
    results = []
    for build in (ops, ops_for_march(march)):
        mine = copy_states(flat, step.n_fields)
        tensors, qtypes, head_w, head_q = step._build(head, mine)
        logits = getattr(build, step.op)(x, tensors, qtypes, model.norm_f, head_w, head_q, *step.consts)
        results.append([logits, *(t for i, t in enumerate(mine) if i % step.n_fields >= step.n_fields - 2)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
