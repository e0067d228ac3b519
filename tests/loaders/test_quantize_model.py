"""Files from quantize_gguf load in rsmem and give logits close to the f32 model's, keep every metadata key,
follow llama.cpp's tensor type choices, and bad requests fail clearly."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest
import torch

import rsmem
from helpers.quant_tiny_models import ARCHS, write_model
from rsmem.errors import ModelFormatError
from rsmem.loaders.quant_rules import PRESETS, ModelInfo, TensorSpec, target_types
from rsmem.loaders.quantize import quantize_gguf, quantize_types

Q = gguf.GGMLQuantizationType
TOKENS = [3, 17, 5, 29, 1, 8, 22, 14, 0, 31, 7, 19]
# max |logit - f32 logit| / max |f32 logit| on the tiny models (random weights), about 1.5x what was measured
REL_BOUND = {
    "f32": 0.0,
    "f16": 1e-3,
    "bf16": 5e-3,
    "q8_0": 1.5e-2,
    "q6_k": 4e-2,
    "q5_0": 6e-2,
    "q5_1": 6e-2,
    "q5_k_s": 6e-2,
    "q5_k_m": 6e-2,
    "q4_0": 1e-1,
    "q4_1": 1e-1,
    "q4_k_s": 1e-1,
    "q4_k_m": 1e-1,
    "q3_k_s": 0.2,
    "q3_k_m": 0.2,
    "q3_k_l": 0.2,
    "q2_k": 0.45,
}


@pytest.fixture(scope="module")
def f32_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("tiny-f32")
    return {arch: write_model(arch, folder / f"{arch}.gguf") for arch in ARCHS}


def _logits(path: Path) -> torch.Tensor:
    ctx = rsmem.Context(rsmem.load_model(path), n_seq_max=1)
    ctx.decode(rsmem.Batch(TOKENS, seq_ids=[[0]] * len(TOKENS), logits=[True] * len(TOKENS)))
    return ctx.logits.clone()


def test_bounds_cover_every_preset() -> None:
    assert set(REL_BOUND) == set(quantize_types())


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_files_load_and_stay_close_to_f32(arch: str, f32_models: dict, tmp_path: Path) -> None:
    ref = _logits(f32_models[arch])
    scale = float(ref.abs().max())
    errors = {}
    for ftype in quantize_types():
        got = _logits(quantize_gguf(f32_models[arch], tmp_path / f"{ftype}.gguf", ftype))
        errors[ftype] = float((got - ref).abs().max()) / scale
        assert errors[ftype] <= REL_BOUND[ftype], (ftype, errors[ftype])
    # more bits, smaller error
    order = ["f16", "bf16", "q8_0", "q6_k", "q4_k_m", "q3_k_m", "q2_k"]
    assert [errors[t] for t in order] == sorted(errors[t] for t in order), errors


@pytest.mark.parametrize("ftype", ["q4_k_m", "f16"])
def test_every_metadata_key_survives(ftype: str, f32_models: dict, tmp_path: Path) -> None:
    src = gguf.GGUFReader(f32_models["mamba"])
    out = gguf.GGUFReader(quantize_gguf(f32_models["mamba"], tmp_path / "q.gguf", ftype))
    rewritten = ["general.quantization_version", "general.file_type"]
    keys = [k for k in src.fields if not k.startswith("GGUF.")]
    # the same keys, in order, the two rewritten ones last (as llama.cpp writes them)
    assert [k for k in out.fields if not k.startswith("GGUF.")] == [
        *(k for k in keys if k not in rewritten),
        *rewritten,
    ]
    for key in keys:
        if key not in rewritten:
            assert out.fields[key].types == src.fields[key].types, key
            assert out.fields[key].contents() == src.fields[key].contents(), key
    assert out.fields["general.file_type"].contents() == int(PRESETS[ftype].file_type)
    assert out.fields["general.quantization_version"].contents() == gguf.GGML_QUANT_VERSION
    assert out.fields["rsmem.test.u64"].types == [gguf.GGUFValueType.UINT64]
    assert out.fields["rsmem.test.strings"].contents() == ["a", "bc", ""]


def test_tensor_types_follow_llamacpp(f32_models: dict, tmp_path: Path) -> None:
    """The choices the fixtures show, spelled out: vectors and the SSM kernels stay F32, a 16-wide row
    falls back to F16, the output is Q6_K, the untied embedding keeps the preset's type, the tied one
    takes the output's."""
    types = {}
    for arch in ARCHS:
        out = gguf.GGUFReader(quantize_gguf(f32_models[arch], tmp_path / f"{arch}.gguf", "q4_k_m"))
        types[arch] = {t.name: t.tensor_type for t in out.tensors}
    assert types["mamba"]["blk.0.ssm_dt.weight"] == Q.F16
    assert types["mamba"]["output.weight"] == Q.Q6_K
    assert types["mamba"]["token_embd.weight"] == Q.Q4_K
    assert types["mamba2"]["token_embd.weight"] == Q.Q6_K
    for arch in ARCHS:
        assert types[arch]["blk.0.ssm_in.weight"] == Q.Q4_K
        assert types[arch]["blk.0.ssm_conv1d.weight"] == Q.F32
        assert types[arch]["blk.0.ssm_a"] == Q.F32
        assert types[arch]["output_norm.weight"] == Q.F32


def test_m_presets_give_more_bits_where_llamacpp_does() -> None:
    """llama.cpp's use_more_bits on a 32-layer model: ffn_down Q6_K in layers 0-3, 28-31 and every third
    between; attn_v likewise (q4_k_m); q4_k_s: Q5_K in the first four attn_v and first four ffn_down."""
    specs = [
        TensorSpec(f"blk.{i}.{k}.weight", (256, 256), Q.F32)
        for i in range(32)
        for k in ("attn_v", "ffn_down")
    ]
    m = target_types(PRESETS["q4_k_m"], specs, ModelInfo(n_layer=32))
    more = [i for i in range(32) if m[f"blk.{i}.ffn_down.weight"] == Q.Q6_K]
    assert more == [0, 1, 2, 3, 6, 9, 12, 15, 18, 21, 24, 27, 28, 29, 30, 31]
    assert [i for i in range(32) if m[f"blk.{i}.attn_v.weight"] == Q.Q6_K] == more
    s = target_types(PRESETS["q4_k_s"], specs, ModelInfo(n_layer=32))
    assert [i for i in range(32) if s[f"blk.{i}.ffn_down.weight"] == Q.Q5_K] == [0, 1, 2, 3]
    assert [i for i in range(32) if s[f"blk.{i}.attn_v.weight"] == Q.Q5_K] == [0, 1, 2, 3]


def test_unknown_type_lists_the_valid_ones(f32_models: dict, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown quantization type 'q9_k'; valid types: f32, f16, .*q6_k"):
        quantize_gguf(f32_models["mamba"], tmp_path / "out.gguf", "q9_k")
    assert not (tmp_path / "out.gguf").exists()


def test_missing_input_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf: no such file"):
        quantize_gguf(tmp_path / "nope.gguf", tmp_path / "out.gguf", "q8_0")


def test_truncated_input_names_the_tensor_and_writes_nothing(f32_models: dict, tmp_path: Path) -> None:
    data = f32_models["mamba2"].read_bytes()
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(data[: len(data) - 100])  # inside the last tensor (1024 bytes, no padding after it)
    with pytest.raises(ModelFormatError, match=r"tensor 'output_norm\.weight'"):
        quantize_gguf(bad, tmp_path / "out.gguf", "q4_k_m")
    assert list(tmp_path.iterdir()) == [bad]
