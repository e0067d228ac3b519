"""What a benchmark architecture module (``bench/archs_*.py``) gives ``bench/throughput.py``.

Each such module defines ``ARCHS: dict[str, BenchArch]``; their keys become ``--arch`` values.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

# Extra columns: column name -> row -> tokens/s, measured once per run on the GGUF just built.
Columns = Callable[[Path, argparse.Namespace], dict[str, dict[str, float]]]


@dataclass(frozen=True)
class BenchArch:
    """``build(folder)`` writes a random 130M-class f32 GGUF into the empty ``folder`` and returns its path;
    ``columns`` measures other programs on it (e.g. the ``rwkv`` package); ``rows`` adds rows to the table,
    such as ``"decode1@4096"`` (one sequence decoding after a 4,096-token prompt)."""

    build: Callable[[Path], Path]
    columns: Columns | None = None
    rows: tuple[str, ...] = ()


def row_shape(row: str) -> tuple[int, int]:
    """A row's sequence count and the context each sequence holds before the timed steps: ``"decode8"``
    is ``(8, 0)``, ``"decode1@4096"`` ``(1, 4096)`` (the context is one sequence's prompt, so only
    one-sequence rows take one)."""
    seqs, _, context = row.removeprefix("decode").partition("@")
    n, c = int(seqs), int(context or 0)
    if c and n != 1:
        raise ValueError(f"row {row!r}: only one-sequence rows take a context")
    return n, c
