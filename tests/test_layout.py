"""The package's layout keeps what docs/architecture.md promises: no import cycle among rsmem's modules
(imports under ``TYPE_CHECKING`` aside), every architecture registered once with its family, and each
family's models in that family's package."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import rsmem
from rsmem.errors import ModelFormatError
from rsmem.loaders import load_model
from rsmem.loaders.registry import ARCHS, SUPPORTED_ARCHS, arch, archs_of

SRC = Path(rsmem.__file__).parent
FIXTURES = Path(__file__).parent / "fixtures" / "llamacpp"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in SRC.rglob("*.py"):
        parts = ["rsmem", *path.relative_to(SRC).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def import_graph(mods: dict[str, Path]) -> dict[str, set[str]]:
    """Module -> the rsmem modules it imports anywhere (function bodies too), but not under TYPE_CHECKING.
    ``from a import b`` is an edge to ``a.b`` when that is a module, else to ``a``."""
    graph: dict[str, set[str]] = {m: set() for m in mods}

    def visit(module: str, nodes: list[ast.stmt]) -> None:
        for node in nodes:
            for sub in ast.walk(node) if not isinstance(node, ast.If) else [node]:
                if isinstance(sub, ast.If):
                    if not _is_type_checking(sub.test):
                        visit(module, sub.body)
                    visit(module, sub.orelse)
                elif isinstance(sub, ast.Import):
                    graph[module].update(a.name for a in sub.names if a.name in mods)
                elif isinstance(sub, ast.ImportFrom) and sub.module and not sub.level:
                    for a in sub.names:
                        full = f"{sub.module}.{a.name}"
                        if full in mods:
                            graph[module].add(full)
                        elif sub.module in mods:
                            graph[module].add(sub.module)

    for module, path in mods.items():
        visit(module, ast.parse(path.read_text(encoding="utf-8")).body)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    comp = []
                    while True:
                        m = stack.pop()
                        on_stack.discard(m)
                        comp.append(m)
                        if m == node:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_rsmem_modules():
    assert cycles(import_graph(_modules())) == []


def test_the_graph_sees_function_level_imports_and_skips_type_checking(tmp_path):
    mods = {"rsmem.x": tmp_path / "x.py", "rsmem.y": tmp_path / "y.py"}
    mods["rsmem.x"].write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import rsmem.y\n")
    mods["rsmem.y"].write_text("def f():\n    from rsmem import x\n")
    assert import_graph(mods) == {"rsmem.x": set(), "rsmem.y": {"rsmem.x"}}


def test_every_architecture_is_registered_once_with_its_family():
    assert SUPPORTED_ARCHS == (
        "mamba", "mamba2", "lfm2", "nemotron_h", "qwen35", "rwkv7", "rwkv6", "arwkv7", "rwkv6qwen2"
    )  # fmt: skip
    families = {a.family for a in ARCHS.values()}
    assert families == {"mamba", "rwkv", "hybrid"}
    assert sorted(sum((archs_of(f) for f in families), ())) == sorted(SUPPORTED_ARCHS)
    with pytest.raises(ModelFormatError, match="unsupported architecture 'llama'"):
        arch("llama")


@pytest.mark.parametrize(
    "path",
    ["mamba/model-bf16.gguf", "mamba2/model-bf16.gguf", "lfm2/model-f32.gguf", "nemotron_h/model-f32.gguf",
     "qwen35/model-f32.gguf", "rwkv/rwkv7/model-f32.gguf", "rwkv/rwkv6/model-f32.gguf"],
)  # fmt: skip
def test_a_loaded_model_lives_in_its_familys_package(path):
    file = FIXTURES / path
    if not file.exists():  # the fixtures' names, checked so that a rename cannot skip this test quietly
        pytest.fail(f"fixture {file} is missing")
    model = load_model(file, n_threads=1, compile=False)
    family = ARCHS[model.arch].family
    assert type(model).__module__.startswith(f"rsmem.models.{family}."), type(model).__module__
