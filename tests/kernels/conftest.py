"""Fixtures of the kernel tests (a test module's own fixture of the same name takes precedence)."""

from __future__ import annotations

from typing import Any

import pytest

from rsmem.kernels.build import native_ops


@pytest.fixture(scope="module")
def ops() -> Any:
    """This machine's C++ kernels, which must build here."""
    built = native_ops()
    assert built is not None, "the C++ kernels must build here"
    return built
