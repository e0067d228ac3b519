"""The few-row float32 product in C++ (``csrc/rows_f32.cpp``: ``rsmem_native.rows_f32`` and ``rows_linear``)
against its twin ``x @ w.t()`` (:func:`rsmem.models.step.small_rows.rows_ref`): every row count of a register
group and past it, tails along both dimensions, chunked long rows, strided operands, the AVX2 and portable
builds; ``rows_linear``'s route by row count; a compiled function calling it with a dynamic batch; the
fallback to oneDNN's packed twin when the kernels are not built."""

from __future__ import annotations

import pytest
import torch

from helpers.kernel_variants import ops_for_march
from rsmem.kernels import build
from rsmem.kernels.quant import kernels_active
from rsmem.models.step import small_rows
from rsmem.models.step.compiled import has_cxx_compiler
from rsmem.models.step.fused import Packed, matmul_rows
from rsmem.models.step.small_rows import SmallRows, rows_f32, rows_operand, rows_ref

pytestmark = pytest.mark.compiled


def native():
    if not kernels_active():
        pytest.skip(f"kernels not built here: {build.build_error()}")
    ops = small_rows.kernel_ops()
    assert ops is not None
    return ops


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def operands(m: int, n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 16, 17, 33, 70])  # 33, 70: the spread prefetch
@pytest.mark.parametrize("n,k", [(768, 768), (53, 45), (40, 3072), (7, 16), (130, 1), (1, 48)])
def test_matches_the_twin(m: int, n: int, k: int) -> None:
    ops = native()
    x, w = operands(m, n, k)
    want = rows_ref(x.double(), w.double())
    got = ops.rows_f32(x, w)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert rel(got.double(), want) < 2e-6


def test_strided_operands_and_empty_shapes() -> None:
    ops = native()
    x, w = operands(6, 70, 100, seed=1)
    wide = torch.randn(70, 160)
    wide[:, 30:130] = w
    w_view = wide[:, 30:130]  # rows contiguous, row stride 160
    x_t = torch.randn(100, 6).t()  # columns contiguous: copied
    want = rows_ref(x_t.double(), w.double())
    assert rel(ops.rows_f32(x_t, w_view).double(), want) < 2e-6
    assert ops.rows_f32(torch.randn(0, 8), torch.randn(5, 8)).shape == (0, 5)
    assert torch.equal(ops.rows_f32(torch.randn(3, 0), torch.randn(5, 0)), torch.zeros(3, 5))
    with pytest.raises(ValueError, match="rows must be contiguous"):
        ops.rows_f32(torch.randn(2, 8), torch.randn(8, 5).t())
    with pytest.raises(ValueError, match="float32"):
        ops.rows_f32(torch.randn(2, 8).double(), torch.randn(5, 8).double())


@pytest.mark.parametrize("m", [3, 16, 17, 40])
def test_rows_linear_routes_by_row_count(m: int) -> None:
    ops = native()
    x, w = operands(m, 96, 64, seed=2)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    got = ops.rows_linear(x, w, packed, 16)
    assert rel(got, rows_ref(x, w)) < 1e-5
    # the product names its route: through the kernel its sums are the kernel's, bit for bit
    assert torch.equal(got, ops.rows_f32(x, w)) == (m <= 16)


def test_wrapper_and_operand_fall_back(monkeypatch: pytest.MonkeyPatch) -> None:
    x, w = operands(4, 33, 20, seed=3)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    monkeypatch.setattr(small_rows, "kernel_ops", lambda namespace="rsmem_native": None)
    assert torch.equal(rows_f32(x, w), rows_ref(x, w))
    operand = rows_operand(w, packed)
    assert isinstance(operand, Packed)
    torch.testing.assert_close(matmul_rows(x, operand), rows_ref(x, w), rtol=1e-5, atol=1e-5)


def test_operand_uses_the_kernel_when_built() -> None:
    native()
    x, w = operands(5, 33, 20, seed=4)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 8)
    operand = rows_operand(w, packed)
    assert isinstance(operand, SmallRows)
    assert isinstance(rows_operand(w.t().contiguous().t(), packed), Packed)  # rows not contiguous
    torch.testing.assert_close(matmul_rows(x, operand), rows_ref(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
def test_compiled_graph_calls_the_op_with_a_dynamic_batch() -> None:
    native()
    w1, w2 = torch.randn(48, 32), torch.randn(32, 48)
    ops1 = rows_operand(w1, torch.ops.mkldnn._reorder_linear_weight(w1, 8))
    ops2 = rows_operand(w2, torch.ops.mkldnn._reorder_linear_weight(w2, 8))

    def f(x: torch.Tensor, a: SmallRows, b: SmallRows) -> torch.Tensor:
        return matmul_rows(torch.relu(matmul_rows(x, a)), b)

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for m in (2, 5, 16, 30):
        x = torch.randn(m, 32)
        torch.testing.assert_close(compiled(x, ops1, ops2), f(x, ops1, ops2), rtol=1e-5, atol=1e-5)
        want = rows_ref(torch.relu(rows_ref(x, w1)), w2)
        torch.testing.assert_close(compiled(x, ops1, ops2), want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"])  # AVX2 + FMA; no AVX (the scalar loop)
def test_other_builds_match_the_twin(march: str) -> None:
    native()
    ops = ops_for_march(march)
    for m, n, k in ((1, 37, 45), (4, 64, 768), (9, 29, 3000), (16, 5, 7)):
        x, w = operands(m, n, k, seed=m)
        assert rel(ops.rows_f32(x, w).double(), rows_ref(x.double(), w.double())) < 2e-6
