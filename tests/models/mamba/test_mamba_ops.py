"""Fast kernels against their plain reference twins (token-by-token recurrences)."""

from __future__ import annotations

import pytest
import torch

from rsmem.models.ops import (
    causal_conv1d,
    causal_conv1d_,
    causal_conv1d_ref,
    gated_group_rms_norm,
    selective_scan,
    selective_scan_,
    selective_scan_ref,
    ssd,
    ssd_chunked,
    ssd_chunked_,
    ssd_ref,
)
from rsmem.models.ops.selective_scan import chunk_bounds
from rsmem.models.step.packed import PackedMatrices, held_matrix, packing_enabled


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n_tokens", [1, 2, 7])
def test_causal_conv_matches_reference(n_tokens: int) -> None:
    g = _gen(n_tokens)
    x, window = torch.randn(3, n_tokens, 10, generator=g), torch.randn(3, 10, 3, generator=g)
    w, b = torch.randn(10, 4, generator=g), torch.randn(10, generator=g)
    y, win = causal_conv1d(x, window, w, b)
    y_ref, win_ref = causal_conv1d_ref(x, window, w, b)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(win, win_ref)
    # the window keeps the newest d_conv-1 inputs, oldest first (llama.cpp's r row)
    assert torch.equal(win[:, :, -1], x[:, -1])


def _mamba_inputs(n_seqs: int, n_tokens: int, dt_scale: float, seed: int = 0):
    g = _gen(seed)
    d, n = 12, 5
    x = torch.randn(n_seqs, n_tokens, d, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(n_seqs, n_tokens, d, generator=g)) * dt_scale
    A = -torch.exp(torch.randn(d, n, generator=g))
    B, C = torch.randn(n_seqs, n_tokens, n, generator=g), torch.randn(n_seqs, n_tokens, n, generator=g)
    D, h = torch.randn(d, generator=g), torch.randn(n_seqs, d, n, generator=g)
    return x, dt, A, B, C, D, h


@pytest.mark.parametrize(("n_tokens", "dt_scale"), [(1, 1.0), (5, 1.0), (70, 0.3), (40, 30.0)])
def test_selective_scan_matches_reference(n_tokens: int, dt_scale: float) -> None:
    args = _mamba_inputs(2, n_tokens, dt_scale)
    y, h = selective_scan(*args, max_chunk=16)
    y_ref, h_ref = selective_scan_ref(*args)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)


def test_chunk_bounds_limit_decay_and_length() -> None:
    assert chunk_bounds([0.0] * 10, max_chunk=4) == [0, 4, 8, 10]
    # decay after a chunk's first token may not pass the limit; a single huge step is its own chunk
    assert chunk_bounds([100.0, 30.0, 31.0, 100.0, 1.0], max_chunk=8, max_log_decay=60.0) == [0, 2, 3, 5]


def _ssd_inputs(n_seqs: int, n_tokens: int, n_group: int, seed: int = 1):
    g = _gen(seed)
    h_, p, n = 4, 3, 5
    x = torch.randn(n_seqs, n_tokens, h_, p, generator=g)
    dt = torch.nn.functional.softplus(torch.randn(n_seqs, n_tokens, h_, generator=g))
    A = -torch.exp(torch.randn(h_, generator=g))
    B = torch.randn(n_seqs, n_tokens, n_group, n, generator=g)
    C = torch.randn(n_seqs, n_tokens, n_group, n, generator=g)
    D, h = torch.randn(h_, generator=g), torch.randn(n_seqs, h_, p, n, generator=g)
    return x, dt, A, B, C, D, h


@pytest.mark.parametrize(("n_tokens", "n_group", "chunk"), [(1, 1, 4), (9, 2, 4), (16, 4, 8), (23, 1, 64)])
def test_ssd_chunked_matches_reference(n_tokens: int, n_group: int, chunk: int) -> None:
    args = _ssd_inputs(3, n_tokens, n_group)
    y, h = ssd_chunked(*args, chunk_size=chunk)
    y_ref, h_ref = ssd_ref(*args)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(h, h_ref, rtol=1e-4, atol=1e-4)


def test_gated_norm_normalises_each_group() -> None:
    g = _gen(2)
    y, z = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    out = gated_group_rms_norm(y, z, torch.ones(8), n_group=2, eps=0.0)
    groups = out.view(2, 2, 4)
    torch.testing.assert_close(groups.square().mean(-1), torch.ones(2, 2))


@pytest.mark.parametrize("n_tokens", [1, 6])
def test_in_place_kernels_update_the_given_rows(n_tokens: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``_`` kernels write their states into the tensors passed (views of memory rows), nothing else."""
    monkeypatch.setattr(ssd, "STATE_BLOCK_BYTES", 1)  # decode one sequence's state at a time
    x, dt, A, B, C, D, h = _mamba_inputs(2, n_tokens, 1.0)
    rows = torch.randn(4, *h.shape[1:])
    rows[1:3] = h
    before = rows.clone()
    y = selective_scan_(x, dt, A, B, C, D, rows[1:3])
    y_ref, h_ref = selective_scan_ref(x, dt, A, B, C, D, h)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[1:3], h_ref, rtol=1e-4, atol=1e-4)
    assert torch.equal(rows[0], before[0]) and torch.equal(rows[3], before[3])

    x, dt, A, B, C, D, h = _ssd_inputs(2, n_tokens, n_group=2)
    rows = torch.randn(3, *h.shape[1:])
    rows[:2] = h
    y = ssd_chunked_(x, dt, A, B, C, D, rows[:2], chunk_size=4)
    y_ref, h_ref = ssd_ref(x, dt, A, B, C, D, h)
    torch.testing.assert_close(y, y_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(rows[:2], h_ref, rtol=1e-4, atol=1e-4)

    window = torch.randn(2, 10, 3)
    xc, w, b = torch.randn(2, n_tokens, 10), torch.randn(10, 4), torch.randn(10)
    y_ref, win_ref = causal_conv1d_ref(xc, window, w, b)
    y = causal_conv1d_(xc, window, w, b)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(window, win_ref)


@pytest.mark.skipif(not packing_enabled(), reason="oneDNN packing unavailable")
def test_packed_linear_matches_plain_product() -> None:
    g = _gen(3)
    w, other = torch.randn(24, 40, generator=g), torch.randn(24, 40, generator=g)
    packed = PackedMatrices()
    packed.add(w)
    for shape in [(1, 24), (3, 24), (2, 5, 24)]:
        x = torch.randn(*shape, generator=g)
        torch.testing.assert_close(packed.linear(x, w), x @ w, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(packed.linear(x, other), x @ other)  # not packed: the plain product


@pytest.mark.skipif(not packing_enabled(), reason="oneDNN packing unavailable")
def test_packed_linear_one_row_on_held_matrix() -> None:
    """A matrix held as the view of its ``[out, in]`` original: one row goes through oneDNN on that matrix,
    several rows through the packed twin."""
    g = _gen(4)
    packed = PackedMatrices()
    for n_in, n_out in [(1024, 256), (24, 40)]:
        weight = torch.randn(n_out, n_in, generator=g)
        w = held_matrix(weight, torch.float32, packing=True)
        assert w.shape == (n_in, n_out) and w.data_ptr() == weight.data_ptr()  # a view, no copy
        packed.add(w)
        for shape in [(1, n_in), (1, 1, n_in), (3, n_in), (2, 5, n_in)]:
            x = torch.randn(*shape, generator=g)
            torch.testing.assert_close(packed.linear(x, w), x @ weight.t(), rtol=1e-4, atol=1e-4)
