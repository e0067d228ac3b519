"""The prompt norms in C++ (``csrc/gated_norm.cpp``, the op ``rsmem_native.gated_rms_norm``) against their
torch twins: Mamba-2's gated norm (``gated_group_rms_norm_ref``: groups, column slices as inputs, the
exponential's range, bad input) and, without a gate, the layers' pre-norm (``rms_norm_ref``); and both
choosing the kernel for prompts only."""

from __future__ import annotations

import pytest
import torch

from helpers.kernel_variants import ops_for_march
from rsmem.kernels import build
from rsmem.kernels.quant import kernels_active
from rsmem.models.ops.norm import gated_group_rms_norm, gated_group_rms_norm_ref, rms_norm, rms_norm_ref

pytestmark = pytest.mark.compiled


def native():
    if not kernels_active():
        pytest.skip(f"kernels not built here: {build.build_error()}")
    return build.native_ops()


def inputs(bs: int, n: int, d: int, seed: int = 0, z_scale: float = 3.0):
    """``y`` contiguous (the scan's output) and ``z`` a column slice of a wider tensor (in_proj's output)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(bs, n, d, generator=g)
    wide = torch.randn(bs, n, d + 2 * d + 7, generator=g) * z_scale
    z = wide[:, :, 3 : 3 + d]
    weight = torch.randn(d, generator=g)
    return y, z, weight


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


SHAPES = [
    (4, 128, 512, 1),  # the embedded Mamba-2
    (2, 70, 1536, 1),  # the 130M Mamba-2
    (3, 9, 96, 4),  # groups of 24: a vector and a tail each
    (1, 2, 40, 8),  # groups of 5: scalar only
    (5, 1, 64, 2),  # one token a sequence: rows spaced by the batch stride
]


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_torch_twin(shape: tuple[int, int, int, int]) -> None:
    ops = native()
    bs, n, d, groups = shape
    y, z, weight = inputs(bs, n, d)
    out = ops.gated_rms_norm(y, z, weight, groups, 1e-5)
    assert out.is_contiguous() and out.shape == y.shape
    assert rel(out, gated_group_rms_norm_ref(y, z, weight, groups, 1e-5)) < 2e-6


@pytest.mark.parametrize("shape", [(4, 128, 256), (2, 65, 768), (3, 2, 40)])
def test_without_a_gate_the_kernel_is_the_pre_norm(shape: tuple[int, int, int]) -> None:
    ops = native()
    y, z, weight = inputs(*shape)
    x = torch.cat([y, z], dim=-1)[..., : shape[2]]  # a column slice: rows spaced wider than D
    want = rms_norm_ref(x, weight, 1e-5)
    assert rel(ops.gated_rms_norm(x, x.new_empty(0), weight, 1, 1e-5), want) < 2e-6
    assert rel(rms_norm(x, weight, 1e-5), want) < 2e-6


def test_the_gate_holds_over_the_exponentials_range() -> None:
    """silu's exponential is the kernel's own polynomial: gates far into both tails, and zero, as torch's."""
    ops = native()
    y = torch.ones(1, 3, 48)
    z = torch.linspace(-120.0, 120.0, 144).reshape(1, 3, 48)
    z[0, 1, 7] = 0.0
    weight = torch.ones(48)
    got, want = ops.gated_rms_norm(y, z, weight, 3, 1e-5), gated_group_rms_norm_ref(y, z, weight, 3, 1e-5)
    assert torch.isfinite(got).all()
    assert rel(got, want) < 2e-6


def test_kernel_refuses_bad_input() -> None:
    ops = native()
    y, z, weight = inputs(2, 8, 32)
    with pytest.raises(RuntimeError, match="n_group must divide"):
        ops.gated_rms_norm(y, z, weight, 5, 1e-5)
    with pytest.raises(RuntimeError, match="weight"):
        ops.gated_rms_norm(y, z, weight[:16], 1, 1e-5)
    with pytest.raises(RuntimeError, match="alike"):
        ops.gated_rms_norm(y, z[:, :4], weight, 1, 1e-5)
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.gated_rms_norm(y, z.transpose(0, 1).contiguous().transpose(0, 1), weight, 1, 1e-5)


@pytest.mark.parametrize("loaded", [False, True])
def test_prompts_take_the_kernel_and_one_token_never(monkeypatch: pytest.MonkeyPatch, loaded: bool) -> None:
    ops = native()
    calls: list[int] = []

    class Spy:
        def gated_rms_norm(self, *args):  # type: ignore[no-untyped-def]
            calls.append(args[0].shape[1])
            return ops.gated_rms_norm(*args)

    monkeypatch.setattr(build, "native_ops", lambda: Spy())
    monkeypatch.setattr(build, "loaded_native_ops", lambda: Spy() if loaded else None)
    for n in (1, 2, build.PROMPT_MIN_TOKENS - 1, build.PROMPT_MIN_TOKENS + 3):
        y, z, weight = inputs(2, n, 64, seed=n)
        got = gated_group_rms_norm(y, z, weight, 2, 1e-5)
        assert rel(got, gated_group_rms_norm_ref(y, z, weight, 2, 1e-5)) < 2e-6
        assert rel(rms_norm(y, weight, 1e-5), rms_norm_ref(y, weight, 1e-5)) < 2e-6
    short = [2, 2, build.PROMPT_MIN_TOKENS - 1, build.PROMPT_MIN_TOKENS - 1] if loaded else []
    assert calls == [*short, build.PROMPT_MIN_TOKENS + 3, build.PROMPT_MIN_TOKENS + 3]


def test_other_dtypes_and_layouts_keep_the_torch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "native_ops", lambda: pytest.fail("the kernel was asked for"))
    monkeypatch.setattr(build, "loaded_native_ops", lambda: pytest.fail("the kernel was asked for"))
    y, z, weight = inputs(2, 80, 32)
    uneven = torch.randn(2, 90, 32)[:, :80]  # token rows evenly spaced within a sequence, not across them
    for args in (
        (y.double(), z.double(), weight.double()),
        (y, z.transpose(1, 2).contiguous().transpose(1, 2), weight),
        (y, uneven, weight),
        (y.reshape(160, 32), z.reshape(160, 32), weight),  # 2-D: a decode step's rows
    ):
        want = gated_group_rms_norm_ref(*args, 2, 1e-5)
        assert torch.allclose(gated_group_rms_norm(*args, 2, 1e-5), want, atol=1e-6)
    for x, w in (
        (y.double(), weight.double()),
        (z.transpose(1, 2).contiguous().transpose(1, 2), weight),
        (uneven, weight),
        (y.reshape(160, 32), weight),
    ):
        assert torch.allclose(rms_norm(x, w, 1e-5), rms_norm_ref(x, w, 1e-5), atol=1e-6)


@pytest.mark.slow
def test_portable_build_norms_like_the_twin() -> None:
    native()
    ops = ops_for_march("x86-64-v2")
    y, z, weight = inputs(3, 17, 72)
    assert (
        rel(ops.gated_rms_norm(y, z, weight, 3, 1e-5), gated_group_rms_norm_ref(y, z, weight, 3, 1e-5)) < 2e-6
    )
