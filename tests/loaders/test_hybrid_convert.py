"""``rsmem convert`` of the hybrid fixtures' HF folders against the GGUF files llama.cpp's own converter
wrote from the same folders: every ``{arch}.*`` metadata value and every tensor (name, type, shape, bytes)
identical. (The tokenizer keys are the shared tokenizer writer's and are not compared here.)"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

import rsmem

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"


def _arch_fields(reader: gguf.GGUFReader, arch: str) -> dict[str, object]:
    keys = [k for k in reader.fields if k.startswith(f"{arch}.") or k == "general.file_type"]
    return {k: reader.fields[k].contents() for k in keys}


@pytest.mark.parametrize("arch", ["lfm2", "nemotron_h"])
def test_convert_matches_llamacpp_converter(arch: str, tmp_path: Path) -> None:
    mine = gguf.GGUFReader(rsmem.convert(FIXTURES / arch / "hf", tmp_path / "m.gguf", "f32"))
    ref = gguf.GGUFReader(FIXTURES / arch / "model-f32.gguf")
    assert mine.fields["general.architecture"].contents() == arch
    assert _arch_fields(mine, arch) == _arch_fields(ref, arch)
    assert mine.fields["tokenizer.ggml.add_bos_token"].contents() is False
    got = {t.name: t for t in mine.tensors}
    want = {t.name: t for t in ref.tensors}
    assert set(got) == set(want)
    for name, t in want.items():
        g = got[name]
        assert (g.tensor_type, list(g.shape)) == (t.tensor_type, list(t.shape)), name
        assert np.array_equal(np.asarray(g.data), np.asarray(t.data)), name


def test_converted_hybrid_loads_and_runs(tmp_path: Path) -> None:
    path = rsmem.convert(FIXTURES / "nemotron_h" / "hf", tmp_path / "m.gguf", "f16")
    model = rsmem.load_model(path)
    ctx = rsmem.Context(model, n_seq_max=1, n_ctx=256)
    ctx.decode(rsmem.Batch([5, 6, 7], seq_ids=[[0]] * 3))
    ref = np.load(FIXTURES / "nemotron_h" / "logits-prompt-f32.npy")
    logits = ctx.get_logits(-1).numpy()
    assert logits.shape[-1] == ref.shape[-1]
    assert np.isfinite(logits).all()
    conv = gguf.GGUFReader(path)
    f32 = {t.name for t in conv.tensors if t.tensor_type == gguf.GGMLQuantizationType.F32}
    assert "blk.0.ssm_conv1d.weight" in f32 and "blk.0.ssm_in.weight" not in f32
