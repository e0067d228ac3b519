"""ops.wkv_lowrank: the one-thread product of RWKV's batched decode steps against its reference twin
``a @ b``, eagerly and compiled with a dynamic batch, and the thread count it runs under and restores; the
one-thread unit lower-triangular inverse of RWKV-7's chunked prefill against ``solve_triangular`` and the
defining identity."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from rsmem.models.ops import wkv_lowrank
from rsmem.models.ops.wkv_lowrank import lowrank, matmul_one_thread, unit_lower_inverse_one_thread
from rsmem.models.step.compiled import has_cxx_compiler

pytestmark = pytest.mark.compiled


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize(
    ("a_shape", "b_shape", "transpose_b"),
    [((64, 768), (32, 768), True), ((5, 64), (768, 64), True), ((5, 3, 32), (5, 32, 40), False)],
)
def test_matches_matmul(two_threads: None, a_shape: Any, b_shape: Any, transpose_b: bool) -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(*a_shape, generator=g)
    b = torch.randn(*b_shape, generator=g)
    b = b.transpose(-1, -2) if transpose_b else b  # a strided view, as the steps pass [out, in] weights
    got = matmul_one_thread(a, b)
    torch.testing.assert_close(got, a @ b, rtol=1e-6, atol=1e-5)
    assert got.is_contiguous()
    assert torch.get_num_threads() == 2


def test_runs_on_one_thread_and_restores_the_count(two_threads: None, monkeypatch: Any) -> None:
    seen: list[int] = []
    matmul = torch.matmul

    def spy(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return matmul(a, b)

    monkeypatch.setattr(wkv_lowrank.torch, "matmul", spy)
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    torch.testing.assert_close(lowrank(x, w), F.linear(x, w))
    with pytest.raises(RuntimeError):  # shapes that do not multiply: the count is restored all the same
        matmul_one_thread(torch.randn(3, 5), torch.randn(4, 6))
    assert seen == [1, 1]
    assert torch.get_num_threads() == 2


@pytest.mark.skipif(not has_cxx_compiler(), reason="torch.compile needs a C++ compiler")
def test_compiled_with_a_dynamic_batch(two_threads: None) -> None:
    """Inside a compiled function (the op called as it is, the bias and activation fused around it), at
    several batch sizes after one compilation: the same as the eager ``F.linear`` form."""

    def mixer(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(w0 + lowrank(torch.tanh(lowrank(x, w1)), w2))

    def reference(x: torch.Tensor, w0: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(w0 + F.linear(torch.tanh(F.linear(x, w1)), w2))

    g = torch.Generator().manual_seed(1)
    w0 = torch.randn(96, generator=g)
    w1, w2 = torch.randn(16, 96, generator=g), torch.randn(96, 16, generator=g)
    compiled = torch.compile(mixer, fullgraph=True, dynamic=True)
    for n in (2, 5, 64):
        x = torch.randn(n, 96, generator=g)
        torch.testing.assert_close(compiled(x, w0, w1, w2), reference(x, w0, w1, w2), rtol=1e-5, atol=1e-5)
    assert torch.get_num_threads() == 2


def test_unit_lower_inverse_is_the_inverse_on_one_thread(two_threads: None, monkeypatch: Any) -> None:
    """``(I - a)^-1`` for a batch of strictly lower ``a``: times ``I - a`` it gives the identity, it equals
    the two-thread ``solve_triangular`` (its twin), it runs on one thread and restores the count."""
    g = torch.Generator().manual_seed(2)
    a = (torch.randn(48, 32, 32, generator=g) * 0.3).tril(-1)
    eye = torch.eye(32)
    seen: list[int] = []
    solve = torch.linalg.solve_triangular

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append(torch.get_num_threads())
        return solve(*args, **kwargs)

    monkeypatch.setattr(wkv_lowrank.torch.linalg, "solve_triangular", spy)
    inv = unit_lower_inverse_one_thread(a)
    monkeypatch.undo()
    torch.testing.assert_close((eye - a) @ inv, eye.expand_as(a), rtol=0, atol=1e-4)
    twin = torch.linalg.solve_triangular(eye - a, eye.expand_as(a), upper=False, unitriangular=True)
    torch.testing.assert_close(inv, twin, rtol=1e-6, atol=1e-6)
    assert torch.tril(inv, -1).abs().sum() > 0 and torch.equal(torch.triu(inv, 1), torch.zeros_like(inv))
    assert seen == [1]
    assert torch.get_num_threads() == 2
