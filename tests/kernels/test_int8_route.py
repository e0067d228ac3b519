"""The int8 routes of rsmem::qmatmul (K-quant weights, activations quantized as llama.cpp's Q8_K, VNNI dot
products; route 3 unpacks blocks in registers, route 4 repacks 16 weight rows into panels; both also take
Q8_0 and Q4_0 against activations quantized per 32 values, as llama.cpp's Q8_0) against their twin: the
quantized activations times the dequantized weights."""

from __future__ import annotations

import pytest
import torch
from test_quant_kernels import (
    INT8_TYPES,
    SMALL_REGISTERS_MAX_M,
    Q,
    assert_int8_close,
    q8k_activations,
    random_blocks,
)

from rsmem.kernels import build, dequantize_rows, qmatmul

pytestmark = pytest.mark.compiled


@pytest.fixture
def ops():
    ops = build.native_ops()
    if ops is None:
        pytest.skip(f"kernels not built here: {build.build_error()}")
    if "vnni" not in ops.isa():
        pytest.skip("no AVX512-VNNI here: no int8 route")
    return ops


def varied_activations(m: int, k: int, seed: int) -> torch.Tensor:
    """Rows whose 256-value blocks differ in magnitude by up to 1e4 (one scale per block, not per row), one
    block all zeros (its scale 0), and a block with one large outlier."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g)
    mags = 10.0 ** torch.randint(-2, 3, (m, k // 256), generator=g).float()
    x = (x.view(m, -1, 256) * mags.unsqueeze(-1)).view(m, k)
    x[0, :256] = 0.0
    if k >= 512:
        x[-1, 300] = 1e3
    return x


ALL_INT8 = (*INT8_TYPES, Q.Q8_0, Q.Q4_0)


@pytest.mark.parametrize("qtype", ALL_INT8, ids=lambda t: t.name)
def test_int8_route_matches_its_twin(ops, qtype: Q) -> None:
    """Every tile shape route 3 has (groups of 2 or 4 weight rows and single rows; 1, 2, then 4 activation
    rows at a time and the rest), K of one to eight blocks of 256: within 1e-6 of sum |x w| of the twin (a
    wrong nibble, fifth bit, scale or min order is off by more than 1e-2 of it; for Q8_0 / Q4_0, products
    summed per int32 lane before the correction for unsigned weights gave 2.5e-6)."""
    for n, m, k in (
        (1, 1, 256),
        (4, 1, 512),
        (37, 1, 768),
        (6, 2, 256),
        (9, 3, 1024),
        (131, 5, 768),
        (20, 8, 2048),
        (33, 11, 512),
        (5, 16, 256),
    ):
        blocks = random_blocks(qtype, n, k, seed=n + m)
        x = varied_activations(m, k, seed=n * m)
        y = ops.qmatmul(x, blocks, int(qtype), k, 3)
        assert y.shape == (m, n)
        assert_int8_close(y, x, blocks, qtype, k)
        assert bool(torch.isfinite(y).all())


@pytest.mark.parametrize("qtype", ALL_INT8, ids=lambda t: t.name)
def test_twin_bound_detects_a_wrong_layout(qtype: Q) -> None:
    """The twin's bound fails for weights read in another order: the assertion the route passes is not
    trivially loose (here, values shuffled within each block)."""
    n, k = 8, 512
    blocks = random_blocks(qtype, n, k, seed=3)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(3))
    block = 256 if qtype in INT8_TYPES else 32
    w = dequantize_rows(blocks, qtype, k).view(n, -1, block)
    shuffled = w.flip(-1).reshape(n, k)  # the same values, in another order within each block
    y = (q8k_activations(x, block) @ shuffled.double().T).float()
    with pytest.raises(AssertionError, match="int8 route error"):
        assert_int8_close(y, x, blocks, qtype, k)


# the most rows each type takes route 3 for (csrc/qmatmul.cpp's int8_registers_max_m); beyond, route 4
REGISTERS_MAX_M = {Q.Q4_K: 8, Q.Q5_K: 8, Q.Q6_K: 24, **dict.fromkeys((Q.Q8_0, Q.Q4_0), SMALL_REGISTERS_MAX_M)}


@pytest.mark.parametrize("qtype", ALL_INT8, ids=lambda t: t.name)
def test_default_route_by_rows(ops, qtype: Q) -> None:
    """rsmem::qmatmul takes route 3 up to REGISTERS_MAX_M rows and route 4 beyond (the same floats as the
    forced route; the routes sum in different orders)."""
    blocks = random_blocks(qtype, 40, 512, seed=1)
    top = REGISTERS_MAX_M[qtype]
    for m, route, other in ((1, 3, 4), (top, 3, 4), (top + 1, 4, 3), (64, 4, 3)):
        x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m))
        got = qmatmul(x, blocks, qtype, 512)
        assert torch.equal(got, ops.qmatmul(x, blocks, int(qtype), 512, route)), (m, route)
        assert not torch.equal(got, ops.qmatmul(x, blocks, int(qtype), 512, other)), (m, route)


def test_routes_refused_where_they_have_no_kernel(ops) -> None:
    """Routes 3 and 4 take Q8_0 / Q4_0 only for rows of whole 256-value blocks (rows of 288 values go route
    0 by default for few rows, the bf16 route for many)."""
    for qtype in (Q.Q8_0, Q.Q4_0):
        blocks = random_blocks(qtype, 3, 288)
        for route, m in ((3, 1), (4, 9)):
            with pytest.raises(ValueError, match=f"route {route}"):
                ops.qmatmul(torch.randn(m, 288), blocks, int(qtype), 288, route)
        for m, route in ((1, 0), (9, -1)):
            x = torch.randn(m, 288)
            assert torch.equal(qmatmul(x, blocks, qtype, 288), ops.qmatmul(x, blocks, int(qtype), 288, route))


@pytest.mark.parametrize("route", [3, 4])
@pytest.mark.parametrize("qtype", ALL_INT8, ids=lambda t: t.name)
def test_threads_give_the_same_floats(ops, qtype: Q, route: int) -> None:
    """Outputs split over threads by weight rows: each output is computed the same way whatever the split
    (and the activations are quantized once, before it)."""
    blocks = random_blocks(qtype, 6001, 768, seed=7)  # > 2 MiB: split (csrc/blocks.h's kTaskBytes)
    x = torch.randn(9, 768)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = ops.qmatmul(x, blocks, int(qtype), 768, route)
        torch.set_num_threads(2)
        two = ops.qmatmul(x, blocks, int(qtype), 768, route)
    finally:
        torch.set_num_threads(threads)
    assert_int8_close(one, x, blocks, qtype, 768)
    assert torch.equal(one, two)
