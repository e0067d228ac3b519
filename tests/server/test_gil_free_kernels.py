"""Compiled steps' C++ kernels run without the GIL, so the server's event loop runs during a decode step."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
import torch
from torch._inductor.codecache import CppPythonBindingsCodeCache

from rsmem.models import compiled
from rsmem.models.compiled import CompiledStep, has_cxx_compiler, release_gil_in_kernels

pytestmark = pytest.mark.skipif(not has_cxx_compiler(), reason="no C++ compiler for inductor")


def chain(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    for _ in range(24):  # one fused pointwise kernel, long enough to measure
        x = torch.tanh(x * w + 1.0)
    return x


def twin(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:  # the same kernel, another compiled function
    for _ in range(24):
        x = torch.tanh(x * w + 1.0)
    return x


def spins_during(fn: Callable[[], object], calls: int) -> int:
    """How many loop turns another Python thread made while ``fn`` ran ``calls`` times."""
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    thread = threading.Thread(target=spin)
    thread.start()
    time.sleep(0.01)
    start = count[0]
    for _ in range(calls):
        fn()
    spun = count[0] - start
    stop.set()
    thread.join()
    return spun


def test_kernels_release_the_gil() -> None:
    x, w = torch.randn(1 << 20), torch.randn(1 << 20)
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

    free_spins = spins_during(lambda: step(x, w), 4)
    held_spins = spins_during(lambda: held(x, w), 4)
    # with the GIL held the other thread only runs between kernels (switch interval), else throughout
    assert free_spins > 4 * held_spins, (free_spins, held_spins)


def test_unknown_binding_is_left_alone() -> None:
    saved = CppPythonBindingsCodeCache.call_entry_function
    CppPythonBindingsCodeCache.call_entry_function = "kernel({}); /* another torch */ Py_RETURN_NONE;"
    try:
        assert not release_gil_in_kernels()
        assert "another torch" in CppPythonBindingsCodeCache.call_entry_function
    finally:
        CppPythonBindingsCodeCache.call_entry_function = saved
