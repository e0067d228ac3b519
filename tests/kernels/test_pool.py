"""rsmem's product workers (``csrc/pool.h``, ``pool.cpp``): every index of a range visited exactly once
under each wait policy and thread count, errors reaching the caller, nested ranges, a child after fork,
products bit for bit equal to torch's OpenMP threads' (the pool off), and ``RSMEM_SPIN_US``."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator

import pytest
import torch

from rsmem import settings, threads
from rsmem.kernels import build
from rsmem.kernels.quant import kernels_active

pytestmark = pytest.mark.compiled

POLICIES = [-1, 0, 200]  # off (at::parallel_for), sleep at once, spin 200 us


def native():
    if not kernels_active():
        pytest.skip(f"kernels not built here: {build.build_error()}")
    return build.native_ops()


@pytest.fixture
def ops() -> Iterator[object]:
    ops = native()
    spin, threads = ops.set_pool(200), torch.get_num_threads()
    yield ops
    ops.set_pool(spin)
    torch.set_num_threads(threads)


@pytest.mark.parametrize("spin", POLICIES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize(("n", "grain"), [(1, 1), (7, 1), (7, 100), (1000, 1), (1000, 64), (100_003, 97)])
def test_every_index_once(ops, spin: int, threads: int, n: int, grain: int) -> None:
    torch.set_num_threads(threads)
    ops.set_pool(spin)
    for _ in range(3):  # the same workers again, awake or asleep
        visits = ops.pool_cover(n, grain)
        assert visits.shape == (n,)
        assert bool((visits == 1).all()), (visits != 1).nonzero()[:5]


def test_jobs_run_on_the_pool_only_when_it_is_on(ops) -> None:
    torch.set_num_threads(2)
    ops.set_pool(200)
    jobs = ops.pool_stats()[1]
    ops.pool_cover(1000, 1)
    assert ops.pool_stats()[1] == jobs + 1
    assert ops.pool_stats()[2] >= 1  # a worker started
    ops.set_pool(-1)  # off: torch's OpenMP threads
    ops.pool_cover(1000, 1)
    ops.pool_cover(1, 1)
    assert ops.pool_stats()[1] == jobs + 1
    ops.set_pool(0)
    torch.set_num_threads(1)  # one thread: nothing to hand out
    ops.pool_cover(1000, 1)
    assert ops.pool_stats()[1] == jobs + 1


@pytest.mark.parametrize("spin", POLICIES)
def test_an_error_reaches_the_caller_and_the_pool_goes_on(ops, spin: int) -> None:
    torch.set_num_threads(2)
    ops.set_pool(spin)
    for throw_at in (0, 517, 999):
        with pytest.raises(RuntimeError, match="pool_cover: range"):
            ops.pool_cover(1000, 10, throw_at)
        assert bool((ops.pool_cover(1000, 10) == 1).all())


@pytest.mark.parametrize("spin", POLICIES)
def test_nested_ranges_run_inline(ops, spin: int) -> None:
    torch.set_num_threads(2)
    ops.set_pool(spin)
    assert bool((ops.pool_cover(5000, 3, -1, True) == 1).all())


def _child(queue) -> None:  # type: ignore[no-untyped-def]
    ops = build.native_ops()
    torch.set_num_threads(2)
    before = ops.pool_stats()[1]
    ok = all(bool((ops.pool_cover(10_000, 16) == 1).all()) for _ in range(20))
    queue.put((ok, ops.pool_stats()[1] - before))


def test_a_forked_child_starts_its_own_workers(ops) -> None:
    torch.set_num_threads(2)
    ops.set_pool(200)
    ops.pool_cover(1000, 1)  # the parent's worker exists
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_child, args=(queue,))
    child.start()
    ok, jobs = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0
    assert ok
    assert jobs == 20


@pytest.mark.parametrize("m", [1, 3, 8, 13])
def test_products_equal_bit_for_bit_across_policies(ops, m: int) -> None:
    """Each output row is summed by one thread along the whole K, so how the rows are shared changes
    nothing: the few-row kernel (f32) and the Q8_0 register route give identical results."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    torch.set_num_threads(2)
    g = torch.Generator().manual_seed(m)
    w = torch.randn(3000, 768, generator=g)
    x = torch.randn(m, 768, generator=g)
    blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    results = []
    for spin in POLICIES:
        ops.set_pool(spin)
        results.append((ops.rows_f32(x, w), ops.qmatmul(x, blocks, int(GGMLQuantizationType.Q8_0), 768)))
    for rows, q8 in results[1:]:
        assert torch.equal(rows, results[0][0])
        assert torch.equal(q8, results[0][1])
    torch.testing.assert_close(results[0][0], x @ w.t(), rtol=1e-4, atol=1e-4)


def test_spin_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RSMEM_SPIN_US", raising=False)
    assert settings.spin_setting() is None
    monkeypatch.setenv("RSMEM_SPIN_US", " 0 ")
    assert settings.spin_setting() == 0
    monkeypatch.setenv("RSMEM_SPIN_US", "-1")
    assert settings.spin_setting() == -1
    monkeypatch.setenv("RSMEM_SPIN_US", "fast")
    with pytest.raises(ValueError, match="RSMEM_SPIN_US must be a whole number of microseconds, got 'fast'"):
        settings.spin_setting()


def test_product_workers_says_the_policy(ops) -> None:
    ops.set_pool(150)
    spinning = "rsmem's workers, spinning up to 150 us while the core is idle (RSMEM_SPIN_US)"
    assert threads.product_workers() == spinning
    ops.set_pool(0)
    assert threads.product_workers() == "rsmem's workers, sleeping at once (RSMEM_SPIN_US=0)"
    ops.set_pool(-1)
    assert threads.product_workers() == "torch's OpenMP threads (RSMEM_SPIN_US < 0)"
