"""What the tests of the C++ decode steps share (test_mamba_step.py, test_mamba2_step.py)."""

from __future__ import annotations

import warnings
from typing import Any

import torch

import rsmem


def decode(model: Any, steps: int = 5, n_vocab: int = 80, n_seqs: int = 1) -> list[torch.Tensor]:
    """A prompt of 9 + s tokens for each sequence s, then one-token steps of all of them in one batch:
    every step's logits, then the state rows."""
    ctx = rsmem.Context(model, n_seq_max=max(2, n_seqs))
    for s in range(n_seqs):
        prompt = [(t + 7 * s) % n_vocab for t in range(1, 10 + s)]
        ctx.decode(rsmem.Batch(prompt, seq_ids=[[s]] * len(prompt)))
    out = []
    for k in range(steps):
        toks = [(5 * k + 3 + 11 * s) % n_vocab for s in range(n_seqs)]
        ctx.decode(rsmem.Batch(toks, seq_ids=[[s] for s in range(n_seqs)], logits=[True] * n_seqs))
        out.append(ctx.logits.clone())
    return out + [t.clone() for t in (*ctx.memory.r_l, *ctx.memory.s_l)]


def one_step_args(model: Any, state_scale: float = 1.0, rows: int = 1) -> tuple[torch.Tensor, Any, list[Any]]:
    """``(x, head, flat)`` for one call of the step of ``rows`` sequences: random states (times
    ``state_scale``)."""
    head, weights = model.one_sequence_args()
    gen = torch.Generator().manual_seed(1)
    states = [
        model.state_views(
            torch.randn(rows, model.n_embd_r, generator=gen),
            torch.randn(rows, model.n_embd_s, generator=gen) * state_scale,
            rows,
        )
        for _ in range(model.n_layer)
    ]
    flat = [t for w, v in zip(weights, states, strict=True) for t in (*w, *v)]
    return torch.randn(rows, model.config.d_model, generator=gen), head, flat


def copy_states(flat: list[Any], n_fields: int) -> list[Any]:
    """``flat`` with each layer's two states (its last two tensors) copied."""
    return [t.clone() if i % n_fields >= n_fields - 2 else t for i, t in enumerate(flat)]


def row_of(flat: list[Any], n_fields: int, m: int) -> list[Any]:
    """``flat`` with each layer's two states narrowed to sequence ``m``'s row (views)."""
    return [t[m : m + 1] if i % n_fields >= n_fields - 2 else t for i, t in enumerate(flat)]


def assert_matches_twin(model: Any, bound: float, rows: int = 1) -> None:
    """One step of the C++ op for ``rows`` sequences against the compiled step's one-sequence function run
    eagerly on each sequence's row of the same states: logits and states within ``bound`` of their largest
    magnitude."""
    step = model._native
    assert step is not None
    n = step.n_fields
    x, head, flat = one_step_args(model, 0.1, rows)
    mine, theirs = copy_states(flat, n), copy_states(flat, n)
    eps = model.config.eps
    got = step(x, model.norm_f, head, eps, *mine)
    want = torch.cat(
        [step.twin(x[m : m + 1], model.norm_f, head, eps, *row_of(theirs, n, m)) for m in range(rows)]
    )
    assert got.shape == want.shape
    assert float((got - want).abs().max()) <= bound * float(want.abs().max())
    for a, b in zip(mine, theirs, strict=True):
        if a is not b:
            torch.testing.assert_close(a, b, rtol=bound, atol=bound * float(b.abs().max()))


def assert_decode_matches_forward(model: Any, monkeypatch: Any, n_seqs: int = 1) -> None:
    """The model's decode of ``n_seqs`` sequences through the C++ step (checked at its first call, no
    warning) against its layer-by-layer forward: logits and states within 1e-5."""
    model.set_compile(False)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "0")
    want = decode(model, n_seqs=n_seqs)
    monkeypatch.setenv("RSMEM_NATIVE_STEP", "1")
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a failed check would fall back with a warning
        got = decode(model, n_seqs=n_seqs)
    assert model._native is not None and model._native._checked and model._native.failed is None
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
