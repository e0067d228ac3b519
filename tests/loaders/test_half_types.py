"""F16 and BF16 matrices stay 2 bytes a value (QuantMatrix, rsmem's kernels) when the kernels are loaded,
and are widened to float32 at load without them: the two models give the same logits up to float32
summation order, the embedded model the same greedy text, the compiled steps what the eager ones give,
and the resident weights are the file's bytes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gguf
import pytest
import torch

import rsmem
from rsmem.engine import default_model_path
from rsmem.kernels import build
from rsmem.loaders import convert_hf_to_gguf
from rsmem.loaders.tensor_types import Holding, file_summary, open_reader
from rsmem.models.ops.quantized import QuantMatrix
from rsmem.models.step import compiled

pytestmark = pytest.mark.compiled

Q = gguf.GGMLQuantizationType
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
# max |kept - widened| / max |logit|: only the order of float32 sums differs
REL_TOL = 1e-5


@pytest.fixture(autouse=True)
def kernels_loaded() -> Iterator[None]:
    if build.native_ops() is None:
        pytest.skip(f"kernels not built here: {build.build_error()}")
    yield
    build.reset()  # undo any RSMEM_KERNELS=0 the test set (monkeypatch restores the variable first)


def widened(path: Path, monkeypatch: pytest.MonkeyPatch, **kw: object) -> object:
    """The model of ``path`` loaded without kernels (F16 / BF16 matrices converted to float32), then the
    kernels back on for its products."""
    monkeypatch.setenv("RSMEM_KERNELS", "0")
    build.reset()
    model = rsmem.load_model(path, **kw)  # type: ignore[arg-type]
    monkeypatch.delenv("RSMEM_KERNELS")
    build.reset()
    return model


def half_file(arch: str, kind: str, tmp: Path) -> Path:
    """llama.cpp's BF16 fixture, or rsmem's F16 conversion of the same weights."""
    if kind == "bf16":
        return FIXTURES / arch / "model-bf16.gguf"
    return convert_hf_to_gguf(FIXTURES / arch / "hf", tmp / f"{arch}-f16.gguf", outtype="f16")


def held_matrices(model: Any) -> list[Any]:
    layers = model.layers
    return [model.embedding, model.lm_head, *(getattr(ly, n) for ly in layers for n in model.matrices)]


def logits(model: object, tokens: list[int]) -> torch.Tensor:
    """Every prompt position's logits, then 3 tokens decoded one at a time."""
    ctx = rsmem.Context(model, n_seq_max=1)  # type: ignore[arg-type]
    ctx.decode(rsmem.Batch(tokens, seq_ids=[[0]] * len(tokens), logits=[True] * len(tokens)))
    rows = [ctx.logits.clone()]
    for i in range(3):
        ctx.decode(rsmem.Batch([tokens[i]], pos=[len(tokens) + i], seq_ids=[[0]]))
        rows.append(ctx.logits.clone())
    return torch.cat(rows)


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    err = (got - want).abs().max().item() / want.abs().max().item()
    assert err <= REL_TOL, f"{err:.3g} of the largest logit"


@pytest.mark.parametrize("kind", ["bf16", "f16"])
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_half_matrices_are_kept_and_multiply_as_widened(
    arch: str, kind: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = half_file(arch, kind, tmp_path)
    qtype = Q.BF16 if kind == "bf16" else Q.F16
    kept = rsmem.load_model(path)
    matrices = held_matrices(kept)
    assert all(isinstance(m, QuantMatrix) and m.qtype == qtype for m in matrices)
    assert all(m.nbytes == 2 * m.numel() for m in matrices)  # type: ignore[union-attr]
    plain = widened(path, monkeypatch)
    assert all(isinstance(m, torch.Tensor) and m.dtype == torch.float32 for m in held_matrices(plain))
    tokens = [1, 5, 9, 14, 3, 7, 2, 11, 4, 8, 6, 10]
    assert_close(logits(kept, tokens), logits(plain, tokens))


def test_summary_says_how_half_types_are_held(monkeypatch: pytest.MonkeyPatch) -> None:
    path = FIXTURES / "mamba2" / "model-bf16.gguf"
    by_type = {s.type_name: s for s in file_summary(path)}
    assert by_type["BF16"].holding is Holding.KEPT_2BYTES
    assert by_type["BF16"].held_bytes == by_type["BF16"].file_bytes
    assert {s.holding for s in file_summary(path, keep=False)} <= {Holding.AS_STORED, Holding.CONVERTED}
    monkeypatch.setenv("RSMEM_KERNELS", "0")
    build.reset()
    assert {s.type_name: s.holding for s in file_summary(path)}["BF16"] is Holding.CONVERTED


def _resident_bytes(model: Any) -> int:
    """Bytes of every weight the model holds (each storage once), packed twins included."""
    seen: set[int] = set()
    total = 0
    stack: list[Any] = [model.embedding, model.lm_head, model.norm_f, model.layers]
    while stack:
        obj = stack.pop()
        if isinstance(obj, QuantMatrix):
            obj = obj.blocks
        if isinstance(obj, torch.Tensor):
            if obj.data_ptr() not in seen:
                seen.add(obj.data_ptr())
                total += obj.untyped_storage().nbytes()
        elif isinstance(obj, list):
            stack.extend(obj)
        elif hasattr(obj, "__slots__"):
            stack.extend(getattr(obj, n) for n in obj.__slots__)
    twins = [model.packed.twin(m) for m in held_matrices(model)]
    return total + sum(t.numel() * t.element_size() for t in twins if t is not None)  # opaque: no storage


def test_embedded_model_decodes_the_same_text_from_its_f16_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    path = default_model_path()
    kept = rsmem.load_model(path)
    assert {m.qtype for m in held_matrices(kept)} == {int(Q.F16)}  # type: ignore[union-attr]
    tensor_bytes = sum(int(t.n_bytes) for t in open_reader(path).tensors)
    assert _resident_bytes(kept) <= 1.15 * tensor_bytes
    plain = widened(path, monkeypatch)
    assert _resident_bytes(plain) > 1.8 * tensor_bytes  # float32 matrices and their packed twins
    tokenizer = kept.tokenizer
    assert tokenizer is not None
    tokens = tokenizer.encode("Once upon a time, there was a little girl who").ids
    assert_close(logits(kept, tokens), logits(plain, tokens))

    def greedy(model: object) -> list[int]:
        ctx = rsmem.Context(model, n_seq_max=1)  # type: ignore[arg-type]
        ctx.decode(rsmem.Batch(tokens, seq_ids=[[0]] * len(tokens)))
        out: list[int] = []
        for i in range(24):
            out.append(int(ctx.logits[-1].argmax()))
            ctx.decode(rsmem.Batch([out[-1]], pos=[len(tokens) + i], seq_ids=[[0]]))
        return out

    assert greedy(kept) == greedy(plain)


@pytest.mark.skipif(not compiled.has_cxx_compiler(), reason="inductor needs a C++ compiler")
@pytest.mark.parametrize("arch", ["mamba", "mamba2"])
def test_compiled_steps_on_half_matrices_match_eager(arch: str) -> None:
    """One sequence a step, then three together (the batched step), compiled against eager."""
    path = FIXTURES / arch / "model-bf16.gguf"
    runs = []
    for compile_decode in (False, True):
        model = rsmem.load_model(path, compile=compile_decode)
        assert model.compile_decode is compile_decode
        ctx = rsmem.Context(model, n_seq_max=3)
        ctx.decode(rsmem.Batch([1, 2, 3, 4, 5, 6], seq_ids=[[0]] * 2 + [[1]] * 2 + [[2]] * 2))
        out = []
        for k in range(3):
            ctx.decode(rsmem.Batch([7 + k], seq_ids=[[0]]))
            out.append(ctx.logits.clone())
            ctx.decode(rsmem.Batch([3, 4, 5], seq_ids=[[0], [1], [2]], logits=[True] * 3))
            out.append(ctx.logits.clone())
        runs.append(torch.cat(out))
    assert_close(runs[1], runs[0])


def test_info_counts_values_and_says_how_half_matrices_are_held(capsys: pytest.CaptureFixture[str]) -> None:
    """``rsmem info`` on the embedded model: F16 kept as stored, the weights held 1.00x the file's tensor
    bytes, and the parameters counted as values (a kept matrix's bytes are twice its values)."""
    from rsmem.cli import main

    assert main(["info"]) == 0
    out = capsys.readouterr().out
    reader = open_reader(default_model_path())
    values = sum(int(t.n_elements) for t in reader.tensors if t.name != "output.weight")  # a tied head
    assert f"parameters:      {values / 1e6:.2f} M" in out
    f16 = next(line for line in out.splitlines() if " F16 " in line)
    assert f16.endswith("-> kept as stored, 2 bytes a value (rsmem's kernels) (5.52 MB)")
    assert "weights held:    5.59 MB, 1.00x the file's 5.59 MB of tensors" in out
