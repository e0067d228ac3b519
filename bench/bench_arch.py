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
