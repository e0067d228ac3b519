"""F16 and BF16 matrices kept as their 2-byte values (rsmem.kernels, csrc/half_routes.h): the widening
against gguf's, every route of rsmem::qmatmul against the reference twin (widen, then matmul) with tails
along every dimension, the AVX2 and portable builds, threads, torch.compile and bad inputs."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from helpers.kernel_variants import ops_for_march
from rsmem.kernels import HALF_TYPES, MATRIX_TYPES, build, dequantize_rows, qmatmul, qmatmul_ref, row_bytes
from rsmem.models.ops.quantized import QuantMatrix

pytestmark = pytest.mark.compiled

Q = gguf.GGMLQuantizationType
DTYPES = {Q.F16: torch.float16, Q.BF16: torch.bfloat16}
# float32 sums in another order than the reference's: a few float32 epsilons (1.2e-7) of sum_i |x_i w_i|
# (K <= 1000 here); a wrong lane, tail or row is off by ~1e-1 of it
RTOL = 2e-6
# (M, N, K): one row and few rows (route 0; K tails of 1-15 values past the vectors, N past the register
# blocks), more rows (route 1: prefill), empty shapes
SHAPES = [(1, 37, 45), (1, 1, 1), (2, 64, 256), (3, 29, 17), (5, 11, 768), (8, 70, 96), (9, 33, 1000)]
SHAPES += [(16, 40, 64), (17, 24, 48), (32, 35, 128), (33, 19, 80), (100, 130, 256)]


def native():
    ops = build.native_ops()
    if ops is None:
        pytest.skip(f"kernels not built here: {build.build_error()}")
    return ops


def half_matrix(qtype: Q, n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``[n, k]`` values of ``qtype``: as its bytes (``[n, 2k]`` uint8) and widened to float32."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(DTYPES[qtype])
    return w.view(torch.uint8), w.float()


def worst_error(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    """Largest ``|y - x @ w.T|`` (float64) of each output over its ``sum_i |x_i w_i|``."""
    if y.numel() == 0:
        return 0.0
    exact = x.double() @ w.double().T
    magnitude = (x.abs().double() @ w.abs().double().T).clamp_min(1e-30)
    return ((y.double() - exact).abs() / magnitude).max().item()


@pytest.mark.parametrize("qtype", HALF_TYPES, ids=lambda t: t.name)
def test_widening_equals_gguf(qtype: Q) -> None:
    """The torch twin and the C++ widening give gguf's float32 values, specials included."""
    blocks, _ = half_matrix(qtype, 5, 77, seed=1)
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), 0.0, -0.0, 6e-8, 1e-40])
    blocks[0, : 2 * len(specials)] = specials.to(DTYPES[qtype]).view(torch.uint8)
    ref = gguf.quants.dequantize(blocks.numpy(), qtype)
    np.testing.assert_array_equal(dequantize_rows(blocks, qtype, 77).numpy(), ref)
    np.testing.assert_array_equal(native().dequantize(blocks, int(qtype), 77).numpy(), ref)


@pytest.mark.parametrize("qtype", HALF_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("route", [-1, 0, 1])
def test_every_route_matches_the_twin(qtype: Q, route: int) -> None:
    ops = native()
    for m, n, k in SHAPES:
        blocks, w = half_matrix(qtype, n, k, seed=m * 1000 + n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(k))
        y = ops.qmatmul(x, blocks, int(qtype), k, route)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert worst_error(y, x, w) <= RTOL, (m, n, k)
        assert worst_error(qmatmul_ref(x, blocks, qtype, k), x, w) <= RTOL


@pytest.mark.parametrize("qtype", HALF_TYPES, ids=lambda t: t.name)
def test_public_op_and_quant_matrix(qtype: Q) -> None:
    """rsmem::qmatmul (the models' path) and QuantMatrix's product and rows, strided and empty inputs."""
    native()
    blocks, w = half_matrix(qtype, 50, 96, seed=3)
    matrix = QuantMatrix(blocks, int(qtype), (50, 96))
    x = torch.randn(96, 4).T  # not contiguous
    assert worst_error(qmatmul(x, blocks, qtype, 96), x, w) <= RTOL
    assert worst_error(matrix.matmul_t(x.reshape(2, 2, 96)).reshape(4, 50), x, w) <= RTOL
    assert torch.equal(matrix.rows(torch.tensor([[3, 0], [49, 3]])), w[torch.tensor([[3, 0], [49, 3]])])
    assert torch.equal(matrix.dequantize(), w)
    assert matrix.nbytes == 50 * 96 * 2
    assert qmatmul(torch.zeros(0, 96), blocks, qtype, 96).shape == (0, 50)
    assert qmatmul(torch.zeros(3, 96), blocks[:0], qtype, 96).shape == (3, 0)


@pytest.mark.parametrize("qtype", HALF_TYPES, ids=lambda t: t.name)
def test_threads_give_the_same_floats(qtype: Q) -> None:
    """Route 0 splits output rows between threads; each output's sum is the same whatever the split."""
    ops = native()
    blocks, _ = half_matrix(qtype, 3000, 512, seed=4)  # 3 MB: two threads' worth
    x = torch.randn(4, 512)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.qmatmul(x, blocks, int(qtype), 512, 0)
        torch.set_num_threads(2)
        two = ops.qmatmul(x, blocks, int(qtype), 512, 0)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(one, two)


def test_many_rows_in_chunks() -> None:
    """Route 1 widens a matrix of more than its chunk (16 MiB of float32) a chunk at a time."""
    ops = native()
    blocks, w = half_matrix(Q.F16, 4200, 1024, seed=5)  # 17.2 MB widened: two chunks
    x = torch.randn(40, 1024)
    assert worst_error(ops.qmatmul(x, blocks, int(Q.F16), 1024, 1), x, w) <= RTOL


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])  # AVX2 + F16C + FMA; no AVX (scalar loops)
def test_other_builds_match_the_twin(march: str) -> None:
    native()
    ops = ops_for_march(march)
    for qtype in HALF_TYPES:
        for m, n, k in SHAPES:
            blocks, w = half_matrix(qtype, n, k, seed=m + n)
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            for route in (0, 1):
                assert worst_error(ops.qmatmul(x, blocks, int(qtype), k, route), x, w) <= RTOL, (march, m, k)
        assert torch.equal(ops.dequantize(blocks, int(qtype), k), w)


def test_under_torch_compile_with_a_dynamic_batch() -> None:
    """As the models' batched decode steps compile it: one graph for every row count, routes 0 and 1."""
    native()
    blocks, w = half_matrix(Q.BF16, 21, 64, seed=6)
    compiled = torch.compile(lambda x, b: qmatmul(x, b, Q.BF16, 64) * 2.0, fullgraph=True)
    for m in (3, 40, 2):
        x = torch.randn(m, 64)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.inference_mode():
            y = compiled(x, blocks)
        assert worst_error(y / 2.0, x, w) <= RTOL


@pytest.mark.parametrize("fn", [qmatmul, qmatmul_ref], ids=["qmatmul", "qmatmul_ref"])
def test_bad_inputs_raise_value_error(fn) -> None:
    native()
    blocks, _ = half_matrix(Q.F16, 4, 64, seed=7)
    with pytest.raises(ValueError, match="row_bytes=128"):
        fn(torch.randn(2, 32), blocks, Q.F16, 32)
    with pytest.raises(ValueError, match=r"x must be a float32 \[M, 64\]"):
        fn(torch.randn(2, 64).double(), blocks, Q.BF16, 64)
    with pytest.raises(ValueError, match="2-D uint8"):
        fn(torch.randn(2, 64), blocks.view(torch.float16), Q.F16, 64)
    with pytest.raises(ValueError, match="block size 1"):
        fn(torch.randn(2, 0), blocks[:, :0], Q.F16, 0)


def test_routes_without_a_half_kernel_are_refused() -> None:
    ops = native()
    blocks, _ = half_matrix(Q.F16, 4, 64, seed=8)
    for route in (2, 3, 4):
        with pytest.raises(ValueError, match="routes 0 and 1"):
            ops.qmatmul(torch.randn(2, 64), blocks, int(Q.F16), 64, route)


def test_row_bytes_and_types() -> None:
    assert row_bytes(Q.F16, 45) == 90 and row_bytes(Q.BF16, 1) == 2
    assert set(HALF_TYPES) <= set(MATRIX_TYPES)
    with pytest.raises(ValueError, match="has no kernel"):
        row_bytes(Q.F32, 4)
