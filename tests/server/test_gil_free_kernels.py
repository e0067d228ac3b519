"""Compiled steps' C++ kernels run without the GIL, so the server's event loop runs during a decode step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch._inductor.codecache import CppPythonBindingsCodeCache

from rsmem.models.step import compiled
from rsmem.models.step.compiled import CompiledStep, has_cxx_compiler, release_gil_in_kernels

pytestmark = [
    pytest.mark.compiled,
    pytest.mark.skipif(not has_cxx_compiler(), reason="no C++ compiler for inductor"),
]


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(24):  # one fused pointwise kernel, long enough to measure
        x = torch.tanh(x * w + 1.0)
    return x


def twin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # the same kernel, another compiled function
    for _ in range(24):
        x = torch.tanh(x * w + 1.0)
    return x


def python_ran_during(fn: Callable[[], object]) -> tuple[float, float]:
    """Where in the call of ``fn`` another Python thread woke from a 20 ms sleep and ran a line, as a
    fraction of the call's time (1.0 or more: only once the call ended)."""
    woke: list[float] = []
    thread = threading.Thread(target=lambda: (time.sleep(0.02), woke.append(time.perf_counter())))
    t0 = time.perf_counter()
    thread.start()
    fn()
    t1 = time.perf_counter()
    thread.join()
    return (woke[0] - t0) / (t1 - t0), t1 - t0


def test_kernels_release_the_gil() -> None:
    x, w = torch.randn(1 << 22), torch.randn(1 << 22)
    step = CompiledStep(chain)
    assert release_gil_in_kernels()
    assert CppPythonBindingsCodeCache.call_entry_function == compiled._GIL_FREE_KERNEL_CALL
    torch.testing.assert_close(step(x, w), chain(x, w))
    assert step.failed is None

    # torch's own binding, for the twin only (the binding is part of the kernel's source and cache key)
    held = torch.compile(twin, fullgraph=True, dynamic=False)
    CppPythonBindingsCodeCache.call_entry_function = compiled._TORCH_KERNEL_CALL
    try:
        torch.testing.assert_close(held(x, w), chain(x, w))
    finally:
        CppPythonBindingsCodeCache.call_entry_function = compiled._GIL_FREE_KERNEL_CALL

    # one kernel of a few hundred ms: the other thread runs in it, or only once it returned
    free, seconds = python_ran_during(lambda: step(x, w))
    assert free < 0.7, (free, seconds)
    held_at, seconds = python_ran_during(lambda: held(x, w))
    assert held_at > 0.9, (held_at, seconds)


def test_unknown_binding_is_left_alone() -> None:
    saved = CppPythonBindingsCodeCache.call_entry_function
    CppPythonBindingsCodeCache.call_entry_function = "kernel({}); /* another torch */ Py_RETURN_NONE;"
    try:
        assert not release_gil_in_kernels()
        assert "another torch" in CppPythonBindingsCodeCache.call_entry_function
    finally:
        CppPythonBindingsCodeCache.call_entry_function = saved
