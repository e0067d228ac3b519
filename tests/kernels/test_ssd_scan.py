"""Mamba-2's scan in C++ (``csrc/ssd_scan.cpp``, the op ``rsmem_native.ssd_scan_``) against its token-by-token
twin ``ssd_ref`` / ``ssd_states_at_ref``: outputs, the state left in place, and the states at capture points;
and :func:`ssd_chunked_at_` choosing it for long prompts only, with the chunked form as its fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from helpers.kernel_variants import ops_for_march
from rsmem.kernels import build
from rsmem.kernels.quant import kernels_active
from rsmem.models.ops.ssd import ssd_chunked_at_, ssd_ref, ssd_states_at_ref

pytestmark = pytest.mark.compiled


def inputs(bs: int, n: int, heads: int, p: int, groups: int, d_state: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(bs, n, heads, p, generator=g)
    dt = F.softplus(torch.randn(bs, n, heads, generator=g))
    A = -torch.rand(heads, generator=g) * 2
    B = torch.randn(bs, n, groups, d_state, generator=g)
    C = torch.randn(bs, n, groups, d_state, generator=g)
    D = torch.randn(heads, generator=g)
    h = torch.randn(bs, heads, p, d_state, generator=g)
    return x, dt, A, B, C, D, h


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def native():
    if not kernels_active():
        pytest.skip(f"kernels not built here: {build.build_error()}")
    return build.native_ops()


SHAPES = [
    (1, 70, 8, 64, 1, 64),  # the embedded model's heads
    (3, 65, 6, 16, 2, 40),  # groups, a state width that is not a multiple of 16 (the scalar tail)
    (2, 9, 4, 8, 4, 16),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_scan_matches_the_token_by_token_twin(shape: tuple[int, ...]) -> None:
    ops = native()
    x, dt, A, B, C, D, h0 = inputs(*shape)
    bs, n = shape[0], shape[1]
    at = [(0, 0), (bs - 1, n - 1), (0, n // 2), (bs - 1, n // 2)]
    y_ref, h_ref = ssd_ref(x, dt, A, B, C, D, h0.clone())
    at_ref = ssd_states_at_ref(x, dt, A, B, C, D, h0.clone(), at)
    h = h0.clone()
    y, h_at = ops.ssd_scan_(
        x, dt, A, B, C, D, h, torch.tensor([b for b, _ in at]), torch.tensor([t for _, t in at])
    )
    assert rel(y, y_ref) < 1e-5
    assert rel(h, h_ref) < 1e-5
    assert rel(h_at, at_ref) < 1e-5


def test_scan_refuses_bad_input_and_leaves_the_state() -> None:
    ops = native()
    x, dt, A, B, C, D, h = inputs(1, 8, 4, 8, 2, 16)
    before = h.clone()
    none = torch.zeros(0, dtype=torch.long)
    with pytest.raises(RuntimeError, match="capture point out of range"):
        ops.ssd_scan_(x, dt, A, B, C, D, h, torch.tensor([0]), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="B/C shape"):
        ops.ssd_scan_(
            x, dt, A, B[:, :, :1].repeat(1, 1, 3, 1), C[:, :, :1].repeat(1, 1, 3, 1), D, h, none, none
        )
    assert torch.equal(h, before)


@pytest.mark.parametrize("loaded", [False, True])
def test_long_prompts_take_the_scan_and_short_ones_only_once_the_kernels_are_loaded(
    monkeypatch: pytest.MonkeyPatch, loaded: bool
) -> None:
    ops = native()
    calls: list[int] = []
    real = ops.ssd_scan_

    class Spy:
        def ssd_scan_(self, *args):  # type: ignore[no-untyped-def]
            calls.append(args[0].shape[1])
            return real(*args)

    monkeypatch.setattr(build, "native_ops", lambda: Spy())
    monkeypatch.setattr(build, "loaded_native_ops", lambda: Spy() if loaded else None)
    for n in (1, 2, build.PROMPT_MIN_TOKENS - 1, build.PROMPT_MIN_TOKENS + 7):
        x, dt, A, B, C, D, h0 = inputs(2, n, 4, 16, 2, 32, seed=n)
        at = [(1, n - 1)]
        y_ref, h_ref = ssd_ref(x, dt, A, B, C, D, h0.clone())
        h = h0.clone()
        y, h_at = ssd_chunked_at_(x, dt, A, B, C, D, h, at, chunk_size=16)
        assert rel(y, y_ref) < 1e-5 and rel(h, h_ref) < 1e-5
        assert rel(h_at, ssd_states_at_ref(x, dt, A, B, C, D, h0.clone(), at)) < 1e-5
    short = [2, build.PROMPT_MIN_TOKENS - 1] if loaded else []
    assert calls == [*short, build.PROMPT_MIN_TOKENS + 7]  # one token: the state update, never the scan


def test_loaded_native_ops_never_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    from rsmem.kernels import build

    state: dict[str, object] = {}
    monkeypatch.setattr(build, "_state", state)
    monkeypatch.setattr(build, "_build", lambda: pytest.fail("loaded_native_ops built the kernels"))
    assert build.loaded_native_ops() is None
    state["ops"] = ops = object()
    assert build.loaded_native_ops() is ops


def test_without_kernels_the_chunked_form_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "native_ops", lambda: None)
    x, dt, A, B, C, D, h0 = inputs(1, 80, 4, 16, 1, 32)
    y_ref, h_ref = ssd_ref(x, dt, A, B, C, D, h0.clone())
    h = h0.clone()
    y, _ = ssd_chunked_at_(x, dt, A, B, C, D, h, ())
    assert rel(y, y_ref) < 1e-5 and rel(h, h_ref) < 1e-5


@pytest.mark.slow
def test_portable_build_scans_like_the_twin() -> None:
    native()
    ops = ops_for_march("x86-64-v2")
    x, dt, A, B, C, D, h0 = inputs(2, 33, 4, 8, 2, 48)
    y_ref, h_ref = ssd_ref(x, dt, A, B, C, D, h0.clone())
    h = h0.clone()
    none = torch.zeros(0, dtype=torch.long)
    y, _ = ops.ssd_scan_(x, dt, A, B, C, D, h, none, none)
    assert rel(y, y_ref) < 1e-5 and rel(h, h_ref) < 1e-5
