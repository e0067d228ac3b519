"""The one rule that picks a recurrent model's decode path (:func:`rsmem.models.step.native.decode_path`)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from rsmem.models.step.native import NativeStep
from rsmem.models.step.path import decode_path


class FakeNative:
    """A C++ step that runs for up to ``rows`` sequences."""

    def __init__(self, rows: int) -> None:
        self.rows = rows

    def usable(self, n_seqs: int = 1) -> bool:
        return n_seqs <= self.rows


def path(native: Any, n_seqs: int, compiled: bool, contiguous: bool, alone: bool) -> str:
    return decode_path(
        cast(NativeStep | None, native),
        n_seqs,
        compiled=compiled,
        rows_contiguous=contiguous,
        native_without_compile=alone,
    )


@pytest.mark.parametrize("alone", [False, True])
def test_the_cpp_step_first_where_it_runs(alone: bool) -> None:
    native = FakeNative(rows=4)
    assert path(native, 4, compiled=True, contiguous=True, alone=alone) == "native"
    assert path(native, 5, compiled=True, contiguous=True, alone=alone) == "compiled"  # too many rows
    assert path(native, 1, compiled=True, contiguous=False, alone=alone) == "layers"  # rows not streamed
    assert path(native, 2, compiled=True, contiguous=False, alone=alone) == "compiled"
    assert path(None, 1, compiled=True, contiguous=True, alone=alone) == "compiled"


def test_without_compiling_only_mamba_takes_its_cpp_step() -> None:
    native = FakeNative(rows=4)
    assert path(native, 1, compiled=False, contiguous=True, alone=True) == "native"
    assert path(native, 1, compiled=False, contiguous=True, alone=False) == "layers"
    assert path(None, 3, compiled=False, contiguous=True, alone=True) == "layers"
