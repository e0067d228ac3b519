"""What the tests of the C++ one-sequence steps share (test_mamba_step.py, test_mamba2_step.py)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import rsmem


def decode(model: Any, steps: int = 5, n_vocab: int = 80) -> list[torch.Tensor]:
    """A 9-token prompt, then one-token steps of one sequence: every step's logits, then the state rows."""
    ctx = rsmem.Context(model, n_seq_max=2)
    ctx.decode(rsmem.Batch(list(range(1, 10)), seq_ids=[[0]] * 9))
    out = []
    for k in range(steps):
        ctx.decode(rsmem.Batch([(5 * k + 3) % n_vocab], seq_ids=[[0]]))
        out.append(ctx.logits.clone())
    return out + [t.clone() for t in (*ctx.memory.r_l, *ctx.memory.s_l)]


def one_step_args(model: Any, state_scale: float = 1.0) -> tuple[torch.Tensor, Any, list[Any]]:
    """``(x, head, flat)`` for one call of the one-sequence step: random states (times ``state_scale``)."""
    head, weights = model.one_sequence_args()
    gen = torch.Generator().manual_seed(1)
    states = [
        model.state_views(
            torch.randn(1, model.n_embd_r, generator=gen),
            torch.randn(1, model.n_embd_s, generator=gen) * state_scale,
            1,
        )
        for _ in range(model.n_layer)
    ]
    flat = [t for w, v in zip(weights, states, strict=True) for t in (*w, *v)]
    return torch.randn(1, model.config.d_model, generator=gen), head, flat


def copy_states(flat: list[Any], n_fields: int) -> list[Any]:
    """``flat`` with each layer's two states (its last two tensors) copied."""
    return [t.clone() if i % n_fields >= n_fields - 2 else t for i, t in enumerate(flat)]


def assert_matches_twin(model: Any, bound: float) -> None:
    """One step of the C++ op against the compiled step's function run eagerly, on the same states:
    logits and states within ``bound`` of their largest magnitude."""
    step = model._native
    assert step is not None
    x, head, flat = one_step_args(model, 0.1)
    mine, theirs = copy_states(flat, step.n_fields), copy_states(flat, step.n_fields)
    eps = model.config.eps
    got = step(x, model.norm_f, head, eps, *mine)
    want = step.twin(x, model.norm_f, head, eps, *theirs)
    assert float((got - want).abs().max()) <= bound * float(want.abs().max())
    for a, b in zip(mine, theirs, strict=True):
        if a is not b:
            torch.testing.assert_close(a, b, rtol=bound, atol=bound * float(b.abs().max()))


def assert_decode_matches_forward(model: Any, monkeypatch: Any) -> None:
    """The model's one-sequence decode through the C++ step (checked at its first call, no warning) against
    its layer-by-layer forward: logits and states within 1e-5."""
    model.set_compile(False)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")
    want = decode(model)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed check would fall back with a warning
        got = decode(model)
    assert model._native is not None and model._native._checked and model._native.failed is None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
