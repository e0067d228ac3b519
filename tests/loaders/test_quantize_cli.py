"""``rsmem quantize`` and ``rsmem convert --outtype`` with the quantized types."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

from helpers.quant_tiny_models import write_model
from helpers.rwkv_reference import random_rwkv7
from rsmem.cli import main
from rsmem.loaders import convert_hf_to_gguf
from rsmem.loaders.quantize import quantize_gguf, quantize_types

HF_MAMBA2 = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "mamba2" / "hf"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model("mamba", tmp_path_factory.mktemp("tiny") / "mamba-f32.gguf")


def test_quantize_writes_the_file_and_prints_types_and_sizes(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(tiny), str(out), "--type", "Q4_K_M"]) == 0  # any case, as llama-quantize
    assert out.read_bytes() == quantize_gguf(tiny, tmp_path / "api.gguf", "q4_k_m").read_bytes()
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "input tensor types:"
    assert lines[1].split()[:3] == ["F32", "13", "tensors"]
    assert lines[2] == "output tensor types:"
    rows = {line.split()[0]: line.split()[1] for line in lines[3:-1]}
    assert rows == {"Q4_K": "4", "F32": "7", "F16": "1", "Q6_K": "1"}
    size_in, size_out = tiny.stat().st_size / 1e6, out.stat().st_size / 1e6
    assert lines[-1].startswith(f"file size: {size_in:.3f} MB -> {size_out:.3f} MB (")


def test_bad_type_is_refused_listing_the_valid_ones(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["quantize", str(tiny), str(tmp_path / "q.gguf"), "--type", "q4_k_x"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'q4_k_x'" in err
    for name in quantize_types():
        assert f"'{name}'" in err
    assert not (tmp_path / "q.gguf").exists()


def test_missing_input_and_bad_output_are_one_line_errors(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "nope.gguf"
    assert main(["quantize", str(missing), str(tmp_path / "q.gguf"), "--type", "q8_0"]) == 1
    assert capsys.readouterr().err == f"rsmem: error: the input {missing}: No such file or directory\n"
    out = tmp_path / "no-folder" / "q.gguf"
    assert main(["quantize", str(tiny), str(out), "--type", "q8_0"]) == 1
    assert "the output" in capsys.readouterr().err
    assert main(["quantize", str(tiny), str(tiny), "--type", "q8_0"]) == 1
    assert capsys.readouterr().err == f"rsmem: error: the output {tiny}: is the input file\n"


def test_not_a_gguf_input_is_a_model_format_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF" + b"\xff" * 64)
    assert main(["quantize", str(junk), str(tmp_path / "q.gguf"), "--type", "q8_0"]) == 1
    last = capsys.readouterr().err.splitlines()[-1]
    assert last.startswith(f"rsmem: error: {junk}: corrupt GGUF file: the file's header")


@pytest.mark.parametrize("outtype", ["q4_k_m", "q5_0"])
def test_convert_outtype_quantizes_the_f32_conversion(outtype: str, tmp_path: Path) -> None:
    out = convert_hf_to_gguf(HF_MAMBA2, tmp_path / "c.gguf", outtype)
    f32 = convert_hf_to_gguf(HF_MAMBA2, tmp_path / "f32.gguf", "f32")
    assert out.read_bytes() == quantize_gguf(f32, tmp_path / "q.gguf", outtype).read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.gguf", "f32.gguf", "q.gguf"]  # no leftovers


def test_convert_cli_accepts_the_quantize_types(tmp_path: Path) -> None:
    out = tmp_path / "c.gguf"
    assert main(["convert", str(HF_MAMBA2), str(out), "--outtype", "Q6_K"]) == 0
    types = {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
    assert types == {"F32", "Q8_0"}  # the fixture's rows are 64 wide: Q6_K falls back to Q8_0
    with pytest.raises(ValueError, match="outtype must be one of"):
        convert_hf_to_gguf(HF_MAMBA2, tmp_path / "x.gguf", "q9_k")


def test_convert_pth_outtype_quantizes_the_f32_conversion(tmp_path: Path) -> None:
    from rsmem.loaders import convert_blink_to_gguf

    pth = tmp_path / "model.pth"
    torch.save(random_rwkv7(256, 1, 300, seed=2), pth)
    out = tmp_path / "q.gguf"
    assert main(["convert", str(pth), str(out), "--outtype", "q4_k_m"]) == 0
    f32 = convert_blink_to_gguf(pth, tmp_path / "f32.gguf", outtype="f32")
    assert out.read_bytes() == quantize_gguf(f32, tmp_path / "want.gguf", "q4_k_m").read_bytes()
    assert "Q4_K" in {t.tensor_type.name for t in gguf.GGUFReader(out).tensors}
