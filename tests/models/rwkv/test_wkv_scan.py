"""The C++ WKV scans (kernels/csrc/wkv_scan.cpp: RWKV-7's and RWKV-6's recurrence over a prompt, token by
token) against their per-token twins in float64; the prefill entry points take them where the kernels
are loaded and the chunked kernels where they are not; bad inputs rejected before the state is touched."""

from __future__ import annotations

import pytest
import torch
from test_wkv_ops import inputs

from rsmem.kernels.build import native_ops
from rsmem.models.ops import wkv as wkv_mod
from rsmem.models.ops import wkv6 as wkv6_mod
from rsmem.models.ops.wkv import wkv7_prefill_, wkv7_ref_
from rsmem.models.ops.wkv6 import wkv6_prefill_, wkv6_ref_
from rsmem.models.step.compiled import has_cxx_compiler

pytestmark = [
    pytest.mark.compiled,
    pytest.mark.skipif(not has_cxx_compiler(), reason="the kernels need a C++ compiler"),
]


@pytest.fixture(scope="module")
def ops():
    got = native_ops()
    assert got is not None and hasattr(got, "wkv7_scan")
    return got


# sequences, tokens, heads, head size: whole AVX-512 vectors, and a tail
SHAPES = [(1, 1, 2, 64), (2, 37, 3, 64), (3, 20, 2, 24), (1, 130, 1, 17)]


def _state(bs: int, h: int, n: int) -> torch.Tensor:
    return torch.randn(bs, h, n, n, generator=torch.Generator().manual_seed(5)) * 0.3


@pytest.mark.parametrize(
    ("bs", "length", "h", "n"), [(1, 1, 2, 64), (2, 37, 3, 64), (3, 20, 2, 24), (1, 130, 1, 17)]
)
def test_wkv7_scan_matches_the_token_loop(ops, bs: int, length: int, h: int, n: int) -> None:
    x = inputs(bs, length, h, n)
    s0 = _state(bs, h, n)
    s_ref, s_scan = s0.double(), s0.clone()
    want = wkv7_ref_(s_ref, *(t.double() for t in x))
    got = ops.wkv7_scan(s_scan, *x)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(s_scan.double(), s_ref, rtol=0, atol=1e-5 * float(s_ref.abs().max()))


@pytest.mark.parametrize(
    ("bs", "length", "h", "n"), [(1, 1, 2, 64), (2, 37, 3, 64), (3, 20, 2, 24), (1, 130, 1, 17)]
)
def test_wkv6_scan_matches_the_token_loop(ops, bs: int, length: int, h: int, n: int) -> None:
    r, log_w, k, v, *_ = inputs(bs, length, h, n, seed=1)
    u = torch.randn(h, n, generator=torch.Generator().manual_seed(2)) * 0.5
    s0 = _state(bs, h, n)
    s_ref, s_scan = s0.double(), s0.clone()
    want = wkv6_ref_(s_ref, *(t.double() for t in (r, log_w, k, v, u)))
    got = ops.wkv6_scan(s_scan, r, log_w, k, v, u)
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(s_scan.double(), s_ref, rtol=0, atol=1e-5 * float(s_ref.abs().max()))


def test_prefill_takes_the_scan_where_loaded(ops, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kernels loaded the prefill entry points run the scans; with none, or a float64 input, the
    chunked kernels; both agree."""
    x = inputs(2, 50, 3, 64)
    r, log_w, k, v, *_ = x
    u = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    calls: list[str] = []

    def counting(module, name: str) -> None:  # type: ignore[no-untyped-def]
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(name) or real(*a, **kw))

    counting(wkv_mod, "wkv7_chunked_")
    counting(wkv6_mod, "wkv6_chunked_")
    s_scan, s_chunk = _state(2, 3, 64), _state(2, 3, 64)
    y_scan = wkv7_prefill_(s_scan, *x)
    wkv6_prefill_(_state(2, 3, 64), r, log_w, k, v, u)
    assert calls == []
    wkv6_prefill_(_state(2, 3, 64).double(), *(t.double() for t in (r, log_w, k, v, u)))
    assert calls == ["wkv6_chunked_"]
    monkeypatch.setattr(wkv_mod, "loaded_native_ops", lambda: None)
    y_chunk = wkv7_prefill_(s_chunk, *x)
    assert calls == ["wkv6_chunked_", "wkv7_chunked_"]
    torch.testing.assert_close(y_scan, y_chunk, rtol=0, atol=1e-4 * float(y_chunk.abs().max()))
    torch.testing.assert_close(s_scan, s_chunk, rtol=0, atol=1e-4 * float(s_chunk.abs().max()))


@pytest.mark.parametrize("which", ["wkv7", "wkv6"])
def test_bad_inputs_are_errors_before_the_state_moves(ops, which: str) -> None:
    x = list(inputs(1, 9, 2, 64))
    state = _state(1, 2, 64)
    before = state.clone()
    if which == "wkv7":
        run = lambda s, xs: ops.wkv7_scan(s, *xs)  # noqa: E731
    else:
        u = torch.zeros(2, 64)
        run = lambda s, xs: ops.wkv6_scan(s, *xs[:4], u)  # noqa: E731
    short = list(x)
    short[2] = x[2][:, :5]  # k for 5 tokens of 9
    with pytest.raises(ValueError, match="every input must be"):
        run(state, short)
    with pytest.raises(ValueError, match="state must be"):
        run(state[:, :1], x)
    with pytest.raises(ValueError, match="head size"):
        run(torch.zeros(1, 2, 300, 300), [t.new_zeros(1, 9, 2, 300) for t in x])
    assert torch.equal(state, before)
