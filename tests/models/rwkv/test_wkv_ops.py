"""The WKV kernels against their per-token twin: chunked prefill (any length, chunk sizes that do not divide
it, padding) and the batched one-token step."""

from __future__ import annotations

import pytest
import torch

from rsmem.models.ops.gla import gla_chunked_, gla_ref_, gla_step_
from rsmem.models.ops.wkv import wkv7_chunked_, wkv7_ref_, wkv7_step_
from rsmem.models.ops.wkv6 import wkv6_chunked_, wkv6_ref_, wkv6_step_

DECAY_SCALE = 0.606531


def inputs(bs: int, length: int, h: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(bs, length, h, n, generator=g) for _ in range(3))
    log_w = -DECAY_SCALE * torch.sigmoid(2 * torch.randn(bs, length, h, n, generator=g))
    kk = torch.nn.functional.normalize(torch.randn(bs, length, h, n, generator=g), dim=-1)
    iclr = torch.sigmoid(torch.randn(bs, length, h, n, generator=g))
    return r, log_w, 0.3 * k, v, -kk, kk * iclr


@pytest.mark.parametrize(("length", "chunk"), [(1, 64), (7, 4), (64, 64), (130, 64), (200, 32), (9, 1)])
def test_chunked_matches_token_loop(length: int, chunk: int) -> None:
    x = inputs(2, length, 3, 64)
    s0 = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    s_ref, s_chunk = s0.double(), s0.clone()
    y_ref = wkv7_ref_(s_ref, *(t.double() for t in x))
    y = wkv7_chunked_(s_chunk, *x, chunk_size=chunk)
    assert y.shape == y_ref.shape
    assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()
    assert (s_chunk - s_ref).abs().max() <= 1e-5 * s_ref.abs().max()
    assert (s_chunk - s0).abs().max() > 1e-2  # the state moved


def test_strong_decay_over_long_chunks_stays_finite() -> None:
    r, _, k, v, a, b = inputs(1, 256, 2, 64, seed=3)
    log_w = torch.full_like(r, -DECAY_SCALE)  # the strongest RWKV-7 decay everywhere
    s_ref, s = torch.zeros(1, 2, 64, 64, dtype=torch.float64), torch.zeros(1, 2, 64, 64)
    y_ref = wkv7_ref_(s_ref, r.double(), log_w.double(), k.double(), v.double(), a.double(), b.double())
    y = wkv7_chunked_(s, r, log_w, k, v, a, b, chunk_size=64)
    assert torch.isfinite(y).all()
    assert (y - y_ref).abs().max() <= 1e-5 * y_ref.abs().max()


def test_step_is_one_token_of_the_recurrence() -> None:
    r, log_w, k, v, a, b = inputs(4, 1, 2, 64, seed=7)
    s0 = torch.randn(4, 2, 64, 64)
    s1, s2 = s0.clone(), s0.clone()
    y1 = wkv7_step_(s1, r[:, 0], log_w[:, 0].exp(), k[:, 0], v[:, 0], a[:, 0], b[:, 0])
    # the definition, written out: S = S diag(w) + (S a) b^T + v k^T, y = S r
    w = log_w[:, 0].exp()
    want = s2 * w[:, :, None, :] + torch.einsum("bhvk,bhk->bhv", s2, a[:, 0])[..., None] * b[:, 0, :, None, :]
    want = want + v[:, 0, :, :, None] * k[:, 0, :, None, :]
    torch.testing.assert_close(s1, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y1, torch.einsum("bhvk,bhk->bhv", want, r[:, 0]), rtol=1e-5, atol=1e-4)


def inputs6(bs: int, length: int, h: int, n: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    r, k, v = (torch.randn(bs, length, h, n, generator=g) for _ in range(3))
    log_w = -torch.exp(2 * torch.randn(bs, length, h, n, generator=g))  # decays from ~1 to ~e^-400
    u = torch.randn(h, n, generator=g)
    return r, log_w, k, v, u


@pytest.mark.parametrize(("length", "chunk"), [(1, 16), (7, 4), (40, 16), (100, 32), (9, 1)])
def test_wkv6_chunked_matches_token_loop(length: int, chunk: int) -> None:
    r, log_w, k, v, u = inputs6(2, length, 3, 64)
    s0 = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(5))
    s_ref, s_chunk = s0.double(), s0.clone()
    y_ref = wkv6_ref_(s_ref, r.double(), log_w.double(), k.double(), v.double(), u.double())
    y = wkv6_chunked_(s_chunk, r, log_w, k, v, u, chunk_size=chunk)
    assert torch.isfinite(y).all()
    assert (y - y_ref).abs().max() <= 1e-4 * y_ref.abs().max()
    assert (s_chunk - s_ref).abs().max() <= 1e-5 * s_ref.abs().max()


@pytest.mark.parametrize("group", [1, 2, 5])
def test_wkv6_chunked_in_groups_of_chunks(monkeypatch: pytest.MonkeyPatch, group: int) -> None:
    """The chunks' initial states kept a few chunks at a time (``STATES_BYTES``): the same outputs and final
    state as the token loop, over 13 chunks in groups that do not divide them."""
    from rsmem.models.ops import wkv6

    monkeypatch.setattr(wkv6, "STATES_BYTES", group * 2 * 3 * 64 * 64 * 4)  # group chunks of the state
    r, log_w, k, v, u = inputs6(2, 100, 3, 64, seed=11)
    s0 = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(6))
    s_ref, s_chunk = s0.double(), s0.clone()
    y_ref = wkv6_ref_(s_ref, r.double(), log_w.double(), k.double(), v.double(), u.double())
    y = wkv6_chunked_(s_chunk, r, log_w, k, v, u, chunk_size=8)
    assert (y - y_ref).abs().max() <= 1e-4 * y_ref.abs().max()
    assert (s_chunk - s_ref).abs().max() <= 1e-5 * s_ref.abs().max()


def test_wkv6_step_is_one_token_of_the_recurrence() -> None:
    r, log_w, k, v, u = inputs6(4, 1, 2, 64, seed=7)
    s0 = torch.randn(4, 2, 64, 64)
    s1 = s0.clone()
    w = log_w[:, 0].exp()
    y = wkv6_step_(s1, r[:, 0], w, k[:, 0], v[:, 0], u)
    kv = k[:, 0, :, :, None] * v[:, 0, :, None, :]  # [Bs, H, K, V]
    torch.testing.assert_close(y, torch.einsum("bhk,bhkv->bhv", r[:, 0], s0 + u[None, :, :, None] * kv))
    torch.testing.assert_close(s1, s0 * w[..., None] + kv)


@pytest.mark.parametrize(("length", "chunk"), [(1, 16), (16, 16), (37, 16), (40, 8)])
def test_gla_chunked_matches_token_loop(length: int, chunk: int) -> None:
    """rwkv6qwen2's gated linear attention: the chunked form (RWKV-6's kernel, q one place later) equals
    the per-token loop, output and final state, from a non-zero state."""
    g = torch.Generator().manual_seed(length)
    q, k, v = (torch.randn(2, length, 3, 64, generator=g) for _ in range(3))
    log_w = -torch.exp(torch.randn(2, length, 3, 64, generator=g))
    s0 = torch.randn(2, 3, 64, 64, generator=g)
    ref, got = s0.clone(), s0.clone()
    y_ref = gla_ref_(ref, q, log_w, k, v, 0.125)
    y = gla_chunked_(got, q, log_w, k, v, 0.125, chunk)
    assert y_ref.abs().max() > 1
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-4)
    torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
    # one step by hand: S = diag(w) S + k v^T, y = scale q^T S (the state after the token)
    s = s0.clone()
    y1 = gla_step_(s, q[:, 0], log_w[:, 0].exp(), k[:, 0], v[:, 0], 0.125)
    want_s = s0 * log_w[:, 0].exp().unsqueeze(-1) + k[:, 0].unsqueeze(-1) * v[:, 0].unsqueeze(-2)
    torch.testing.assert_close(s, want_s)
    torch.testing.assert_close(y1, 0.125 * (q[:, 0].unsqueeze(-2) @ want_s).squeeze(-2), rtol=1e-5, atol=1e-4)
