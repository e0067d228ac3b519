"""rsmem quantize writes the files llama.cpp's own quantizer writes, byte for byte: every preset on tiny
Mamba and Mamba-2 models, on the hybrid and RWKV fixtures, and six requantizations
(tests/fixtures/quantize/: llama.cpp's files recorded by sha256, three kept whole; see its README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.quant_tiny_models import describe, sha256, write_model
from rsmem.loaders.quantize import quantize_gguf

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "quantize"
RECORD = json.loads((FIXTURES / "llamacpp.json").read_text())
REPO_SOURCES = {
    "lfm2": "tests/fixtures/llamacpp/lfm2/model-f32.gguf",
    "nemotron_h": "tests/fixtures/llamacpp/nemotron_h/model-f32.gguf",
    "rwkv6": "tests/fixtures/llamacpp/rwkv/rwkv6/model-f32.gguf",
    "rwkv7": "tests/fixtures/llamacpp/rwkv/rwkv7/model-f32.gguf",
}


class Sources:
    """The recorded sources by name, each made (or found) once and checked against its recorded sha256."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.paths: dict[str, Path] = {}

    def get(self, name: str) -> Path:
        if name not in self.paths:
            path = self._make(name)
            assert sha256(path.read_bytes()) == RECORD["sources"][name], (
                f"source {name} is not the file llama.cpp quantized: rerun scripts/make_quant_fixtures.py"
            )
            self.paths[name] = path
        return self.paths[name]

    def _make(self, name: str) -> Path:
        if name.startswith("tiny-") and "@" in name:  # llama.cpp's output, which rsmem writes byte for byte
            base, ftype = name.split("@")
            return quantize_gguf(self.get(base), self.folder / f"{name}.gguf", ftype)
        if name.startswith("tiny-"):
            return write_model(name.removeprefix("tiny-"), self.folder / f"{name}.gguf")
        return ROOT / REPO_SOURCES.get(name, name)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Sources:
    return Sources(tmp_path_factory.mktemp("quant-sources"))


def _case_id(case: dict) -> str:
    return f"{case['source'].removeprefix('tests/fixtures/llamacpp/')}->{case['type']}"


@pytest.mark.parametrize("case", RECORD["cases"], ids=[_case_id(c) for c in RECORD["cases"]])
def test_same_file_as_llamacpp(case: dict, sources: Sources, tmp_path: Path) -> None:
    out = quantize_gguf(sources.get(case["source"]), tmp_path / "out.gguf", case["type"])
    got, want = describe(out), case["output"]
    assert list(got["tensors"]) == list(want["tensors"])  # the same tensors, in llama.cpp's order
    assert {n: t[0] for n, t in got["tensors"].items()} == {n: t[0] for n, t in want["tensors"].items()}
    differ = [n for n in want["tensors"] if got["tensors"][n][1] != want["tensors"][n][1]]
    assert differ == []
    assert (got["size"], got["sha256"]) == (want["size"], want["sha256"])  # header, metadata, padding too


@pytest.mark.parametrize("kept", sorted(FIXTURES.glob("llamacpp-*.gguf")), ids=lambda p: p.stem)
def test_kept_llamacpp_files_byte_for_byte(kept: Path, sources: Sources, tmp_path: Path) -> None:
    source, ftype = kept.stem.removeprefix("llamacpp-").rsplit("-", 1)
    out = quantize_gguf(sources.get(source), tmp_path / "out.gguf", ftype)
    assert out.read_bytes() == kept.read_bytes()


def test_every_preset_and_source_is_covered() -> None:
    """The record holds each preset for each of the six f32 sources, and the requantizations."""
    from rsmem.loaders.quantize import quantize_types

    pairs = {(c["source"], c["type"]) for c in RECORD["cases"]}
    for source in ("tiny-mamba", "tiny-mamba2", *REPO_SOURCES):
        assert {t for s, t in pairs if s == source} == set(quantize_types())
    assert sum("@" in s or s.endswith(".gguf") for s, _ in pairs) == 6
