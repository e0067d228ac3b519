"""Qwen3.5's decode chains (models/hybrid/qwen35_decode.py) give the eager path's logits and states: one
sequence
and several (a chain per stretch between attention layers, attention's KV part eager; several sequences'
chains with the packed products and a dynamic batch), after a prompt, with a fork, with and without output
rows; the chains' functions run eagerly as well as compiled; the one-token delta rule that reads the old
state only against the token-by-token step."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import rsmem
from rsmem.models.hybrid.qwen35 import Qwen35Model
from rsmem.models.hybrid.qwen35_decode import QwenChains, delta_step_
from rsmem.models.ops.delta_net import delta_rule_step, l2_norm
from rsmem.models.step import compiled

pytestmark = pytest.mark.compiled

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "llamacpp" / "qwen35" / "model-f32.gguf"
needs_cxx = pytest.mark.skipif(not compiled.has_cxx_compiler(), reason="inductor needs a C++ compiler")


def _run(model: Qwen35Model) -> list[torch.Tensor]:
    """Prefill two sequences, fork one, decode one sequence alone then three together, the logits of each
    step (the later steps read the states the earlier ones wrote; the last one, after a step without output
    rows, a sequence whose rows moved)."""
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


def _compare(got: list[torch.Tensor], eager: list[torch.Tensor]) -> None:
    assert [t.shape for t in got] == [t.shape for t in eager]
    assert got[-2].shape[0] == 0  # the step without an output row gives none
    for a, b in zip(got, eager, strict=True):
        # this fixture's float32 rounding is large (its README): the two orders differ by up to 5e-6 of
        # the logits' scale (3e-5 at 6); a wrong state or product moves them by 1e-2 and more
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * b.abs().max().item() if b.numel() else 0)


def test_chain_functions_eagerly_match_the_eager_forward() -> None:
    model = rsmem.load_model(FIXTURE, compile=False)
    assert isinstance(model, Qwen35Model) and not model.compile_decode
    eager = _run(model)
    model.set_compile(True)  # builds the chains; then run their functions uncompiled
    model._chains = QwenChains(model._chains.dims, many=False, compiled=False)
    model._chains_many = QwenChains(model._chains.dims, many=True, compiled=False)
    _compare(_run(model), eager)


@needs_cxx
def test_compiled_decode_matches_eager() -> None:
    model = rsmem.load_model(FIXTURE, compile=False)
    eager = _run(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # a compile failure would fall back silently
        model.set_compile(True)
        got = _run(model)
    assert model.compile_decode
    one, many = model._chains.steps, model._chains_many.steps
    assert len(one) >= 2 and len(many) == len(one)  # fixture: 3 delta nets, attention last, then the head
    assert all(s._checked and s.failed is None for s in [*one, *many])  # type: ignore[attr-defined]
    _compare(got, eager)
    assert model.warm_up() > 0


def test_auto_policy_leaves_the_tiny_fixture_eager() -> None:
    model = rsmem.load_model(FIXTURE, compile="auto")
    assert not model.compile_decode and model.warm_up() == 0.0


@pytest.mark.parametrize("n_seqs", [1, 5])
def test_delta_step_reading_the_old_state_matches_the_step(n_seqs: int) -> None:
    torch.manual_seed(1)
    h, dk, dv = 4, 16, 8
    q = l2_norm(torch.randn(n_seqs, h, dk), 1e-6) / dk**0.5
    k = l2_norm(torch.randn(n_seqs, h, dk), 1e-6)
    v, g = torch.randn(n_seqs, h, dv), -torch.rand(n_seqs, h) * 3
    beta = torch.rand(n_seqs, h)
    state = torch.randn(n_seqs, h, dv, dk)
    want_state = state.clone()
    want = delta_rule_step(q, k, v, g, beta, want_state)
    got = delta_step_(q, k, v, g, beta, state)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(state, want_state, rtol=0, atol=1e-5)
    assert not torch.equal(state, torch.zeros_like(state))
