"""The C++ decode steps' operand enums against the Python names they are passed by
(:mod:`rsmem.models.step.operands`): a field added, dropped or moved on one side only fails here, not as a
wrong operand in a step. Reads the sources; builds nothing."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from rsmem.kernels.build import CSRC
from rsmem.models.hybrid import native as hybrid_native
from rsmem.models.mamba.mamba1 import MambaLayer, MambaModel
from rsmem.models.mamba.mamba2 import Mamba2Layer, Mamba2Model
from rsmem.models.rwkv.rwkv6 import Rwkv6Layer, Rwkv6Model
from rsmem.models.rwkv.rwkv7 import Rwkv7Layer, Rwkv7Model
from rsmem.models.step import operands
from rsmem.models.step.operands import StepOperands

STEP_SOURCES = sorted(CSRC.glob("*_step.cpp"))
# an operand enum: struct <Name>Field { enum : int64_t { A, B, ..., N_FIELDS }; };
ENUM = re.compile(r"struct\s+(\w+(?:Field|Matrix))\s*\{\s*enum\s*:\s*int64_t\s*\{([^}]*)\}\s*;\s*\}\s*;")
# a bare number indexing a layer's tensors (t), its qtypes (q, qtypes) or a block's tensors
BARE_INDEX = re.compile(r"\b(?:t|q|qtypes)\[\s*\d+\s*\]|\bqtypes\[\s*\d+\s*\*")


def _code(path: Path) -> str:
    """The source without its comments."""
    text = re.sub(r"/\*.*?\*/", "", path.read_text(), flags=re.DOTALL)
    return re.sub(r"//[^\n]*", "", text)


def cpp_enums() -> dict[str, list[str]]:
    """Every operand enum of the steps and their shared header, by struct name: its names in order."""
    found: dict[str, list[str]] = {}
    for path in [*STEP_SOURCES, CSRC / "step_common.h"]:
        for name, body in ENUM.findall(_code(path)):
            assert name not in found, f"{name} is defined twice ({path.name})"
            items = [item.strip() for item in body.split(",") if item.strip()]
            assert all("=" not in item for item in items), f"{name}: positions follow the order, no values"
            found[name] = items
    return found


def test_the_step_sources_are_found() -> None:
    names = {p.name.removesuffix("_step.cpp") for p in STEP_SOURCES}
    assert {"mamba", "mamba2", "rwkv6", "rwkv7", "hybrid"} <= names


@pytest.mark.parametrize("ops", operands.ALL, ids=lambda ops: ops.name)
def test_cpp_enums_name_the_python_fields_in_order(ops: StepOperands) -> None:
    enums = cpp_enums()
    assert enums.get(f"{ops.name}Field") == [*(f.upper() for f in ops.fields), "N_FIELDS"]
    assert enums.get(f"{ops.name}Matrix") == [*(m.upper() for m in ops.matrices), "N_MATRICES"]


def test_every_cpp_operand_enum_has_its_python_fields() -> None:
    expected = {f"{ops.name}{kind}" for ops in operands.ALL for kind in ("Field", "Matrix")}
    assert set(cpp_enums()) == expected


@pytest.mark.parametrize("path", STEP_SOURCES, ids=lambda p: p.name)
def test_steps_index_their_operands_by_name(path: Path) -> None:
    bare = [m.group(0) for m in BARE_INDEX.finditer(_code(path))]
    assert not bare, f"{path.name} indexes operands by number: {bare}"


def test_hybrid_block_kinds_match_the_op() -> None:
    kinds = re.search(r"enum\s+Kind\s*:\s*int64_t\s*\{([^}]*)\}", _code(CSRC / "hybrid_step.cpp"))
    assert kinds is not None
    values = dict(
        (name.strip(), int(value)) for name, value in (item.split("=") for item in kinds.group(1).split(","))
    )
    python = {
        "kConv": hybrid_native.CONV,
        "kSwiglu": hybrid_native.SWIGLU,
        "kRelu2": hybrid_native.RELU2,
        "kAttention": hybrid_native.ATTENTION,
        "kMamba2": hybrid_native.MAMBA2,
    }
    assert values == python
    assert set(hybrid_native.OPERANDS) == set(python.values())


@pytest.mark.parametrize(
    ("ops", "layer_cls", "model_cls"),
    [
        (operands.MAMBA, MambaLayer, MambaModel),
        (operands.MAMBA2, Mamba2Layer, Mamba2Model),
        (operands.RWKV6, Rwkv6Layer, Rwkv6Model),
        (operands.RWKV7, Rwkv7Layer, Rwkv7Model),
    ],
    ids=lambda v: getattr(v, "name", None) or getattr(v, "__name__", "?"),
)
def test_layers_hold_the_fields_they_pass(ops: StepOperands, layer_cls: type, model_cls: type) -> None:
    held = {f.name for f in dataclasses.fields(layer_cls)}
    assert set(ops.weights) <= held
    assert ops.states == ops.fields[-2:]  # NativeStep's layout: the two states end a layer
    assert model_cls.matrices == ops.matrices


def test_positions_follow_the_names() -> None:
    assert operands.MAMBA2.n_fields == 11
    assert operands.MAMBA2.matrix_positions == (1, 8)
    assert operands.MAMBA.matrix_positions == (1, 4, 9)
    assert hybrid_native.FILLED[hybrid_native.ATTENTION] == (5, 6)
    with pytest.raises(ValueError, match="field order"):
        StepOperands("Bad", fields=("a", "b"), matrices=("b", "a"))
