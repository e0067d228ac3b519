"""The prompt convolution in C++ (``csrc/conv1d.cpp``, the op ``rsmem_native.conv1d_causal_``) against its
token-by-token twin ``causal_conv1d_ref``: outputs, the window left in place, column slices of a wider
tensor as input, prompts shorter than the window; and ``causal_conv1d_`` choosing it for prompts only."""

from __future__ import annotations

import pytest
import torch

from helpers.kernel_variants import ops_for_march
from rsmem.kernels import build
from rsmem.kernels.quant import kernels_active
from rsmem.models.ops.conv import causal_conv1d, causal_conv1d_, causal_conv1d_ref

pytestmark = pytest.mark.compiled


def native():
    if not kernels_active():
        pytest.skip(f"kernels not built here: {build.build_error()}")
    return build.native_ops()


def inputs(bs: int, n: int, channels: int, k: int, bias: bool, seed: int = 0):
    """``x`` as a column slice of a wider tensor (how in_proj's output reaches the conv), not contiguous."""
    g = torch.Generator().manual_seed(seed)
    wide = torch.randn(bs, n, channels + 9, generator=g)
    x = wide[:, :, 4 : 4 + channels]
    window = torch.randn(bs, channels, k - 1, generator=g)
    weight = torch.randn(channels, k, generator=g)
    b = torch.randn(channels, generator=g) if bias else None
    return x, window, weight, b


SHAPES = [
    (4, 128, 640, 4, True),  # the embedded Mamba-2's xBC, four sequences
    (2, 70, 1792, 4, True),  # the 130M Mamba-2's
    (3, 2, 17, 4, False),  # fewer tokens than the window holds: the new window keeps old columns
    (1, 33, 40, 3, True),  # another kernel width, a channel count with a vector tail
    (2, 5, 8, 2, False),
]


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_matches_the_token_by_token_twin(shape: tuple[int, int, int, int, bool]) -> None:
    ops = native()
    x, window0, weight, bias = inputs(*shape)
    y_ref, window_ref = causal_conv1d_ref(x, window0.clone(), weight, bias)
    window = window0.clone()
    y = ops.conv1d_causal_(x, window, weight, x.new_empty(0) if bias is None else bias)
    assert y.is_contiguous() and y.shape == y_ref.shape
    assert float((y - y_ref).abs().max()) < 1e-5 * float(y_ref.abs().max())
    assert torch.equal(window, window_ref)  # copies of inputs, no arithmetic


def test_kernel_refuses_bad_input_and_leaves_the_window() -> None:
    ops = native()
    x, window, weight, bias = inputs(2, 8, 16, 4, True)
    before = window.clone()
    with pytest.raises(RuntimeError, match="window shape"):
        ops.conv1d_causal_(x, torch.zeros(2, 15, 3), weight, bias)
    with pytest.raises(RuntimeError, match="weight must be"):
        ops.conv1d_causal_(x, window, weight[:, :3], bias)
    with pytest.raises(RuntimeError, match="unit stride"):
        ops.conv1d_causal_(x.transpose(1, 2).contiguous().transpose(1, 2), window, weight, bias)
    with pytest.raises(RuntimeError, match="bias"):
        ops.conv1d_causal_(x, window, weight, bias[:5])
    assert torch.equal(window, before)


@pytest.mark.parametrize("loaded", [False, True])
def test_prompts_take_the_kernel_and_one_token_never(monkeypatch: pytest.MonkeyPatch, loaded: bool) -> None:
    ops = native()
    calls: list[int] = []

    class Spy:
        def conv1d_causal_(self, *args):  # type: ignore[no-untyped-def]
            calls.append(args[0].shape[1])
            return ops.conv1d_causal_(*args)

    monkeypatch.setattr(build, "native_ops", lambda: Spy())
    monkeypatch.setattr(build, "loaded_native_ops", lambda: Spy() if loaded else None)
    for n in (1, 2, build.PROMPT_MIN_TOKENS - 1, build.PROMPT_MIN_TOKENS + 3):
        x, window0, weight, bias = inputs(2, n, 24, 4, True, seed=n)
        y_ref, window_ref = causal_conv1d_ref(x, window0.clone(), weight, bias)
        y, window = causal_conv1d(x, window0, weight, bias)
        assert float((y - y_ref).abs().max()) < 1e-5 * float(y_ref.abs().max())
        assert torch.equal(window, window_ref)
    short = [2, build.PROMPT_MIN_TOKENS - 1] if loaded else []
    assert calls == [*short, build.PROMPT_MIN_TOKENS + 3]


def test_other_dtypes_and_layouts_keep_the_torch_form(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(build, "native_ops", lambda: pytest.fail("the kernel was asked for"))
    monkeypatch.setattr(build, "loaded_native_ops", lambda: pytest.fail("the kernel was asked for"))
    x, window, weight, bias = inputs(2, 80, 16, 4, True)
    for args in (
        (x.double(), window.double(), weight.double(), bias.double()),  # float64
        (x.transpose(1, 2).contiguous().transpose(1, 2), window, weight, bias),  # channels not unit stride
        (x, window.transpose(1, 2).contiguous().transpose(1, 2), weight, bias),  # window not contiguous
    ):
        y_ref, window_ref = causal_conv1d_ref(*(t.clone() for t in args))
        y = causal_conv1d_(*args)
        assert torch.allclose(y, y_ref, atol=1e-5) and torch.equal(args[1], window_ref)


@pytest.mark.slow
def test_portable_build_convolves_like_the_twin() -> None:
    native()
    ops = ops_for_march("x86-64-v2")
    x, window0, weight, bias = inputs(2, 21, 37, 4, True)
    y_ref, window_ref = causal_conv1d_ref(x, window0.clone(), weight, bias)
    window = window0.clone()
    y = ops.conv1d_causal_(x, window, weight, bias)
    assert float((y - y_ref).abs().max()) < 1e-5 * float(y_ref.abs().max())
    assert torch.equal(window, window_ref)
