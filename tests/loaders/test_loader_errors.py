"""Malformed model inputs raise ModelFormatError naming the problem."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
from safetensors.numpy import save_file

import rsmem
from rsmem.errors import ModelFormatError


def _write_gguf(
    path: Path,
    arch: str,
    tensors: dict[str, np.ndarray],
    keys: dict[str, int | str],
    tokenizer: dict[str, object] | None = None,
) -> Path:
    w = gguf.GGUFWriter(path, arch)
    for k, v in keys.items():
        if isinstance(v, str):
            w.add_string(f"{arch}.{k}", v)
        else:
            w.add_uint32(f"{arch}.{k}", v)
    for k, v in (tokenizer or {}).items():
        if isinstance(v, list):
            w.add_array(f"tokenizer.ggml.{k}", v)
        else:
            w.add_string(f"tokenizer.ggml.{k}", str(v))
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _tiny_mamba(
    path: Path,
    drop: str | None = None,
    keys_over: dict[str, int | str] | None = None,
    tokenizer: dict[str, object] | None = None,
) -> Path:
    d, di, n, r, k, v = 8, 16, 4, 2, 4, 16
    f = np.float32
    tensors = {
        "token_embd.weight": np.ones((v, d), f),
        "output_norm.weight": np.ones(d, f),
        "blk.0.attn_norm.weight": np.ones(d, f),
        "blk.0.ssm_in.weight": np.ones((2 * di, d), f),
        "blk.0.ssm_conv1d.weight": np.ones((di, k), f),
        "blk.0.ssm_conv1d.bias": np.ones(di, f),
        "blk.0.ssm_x.weight": np.ones((r + 2 * n, di), f),
        "blk.0.ssm_dt.weight": np.ones((di, r), f),
        "blk.0.ssm_dt.bias": np.ones(di, f),
        "blk.0.ssm_a": -np.ones((di, n), f),
        "blk.0.ssm_d": np.ones(di, f),
        "blk.0.ssm_out.weight": np.ones((d, di), f),
    }
    tensors.pop(drop or "", None)
    keys: dict[str, int | str] = {
        "embedding_length": d,
        "block_count": 1,
        "ssm.conv_kernel": k,
        "ssm.inner_size": di,
        "ssm.state_size": n,
        "ssm.time_step_rank": r,
    }
    return _write_gguf(path, "mamba", tensors, keys | (keys_over or {}), tokenizer)


def test_minimal_gguf_loads(tmp_path: Path) -> None:
    model = rsmem.load_model(_tiny_mamba(tmp_path / "ok.gguf"))
    assert (model.arch, model.n_vocab, model.n_layer) == ("mamba", 16, 1)


def test_not_a_gguf(tmp_path: Path) -> None:
    p = tmp_path / "x.gguf"
    p.write_bytes(b"this is not a model at all")
    with pytest.raises(ModelFormatError, match="not a GGUF"):
        rsmem.load_model(p)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ModelFormatError, match="no such model file"):
        rsmem.load_model(tmp_path / "absent.gguf")


@pytest.mark.parametrize("keep", [20, 200, 0.9])
def test_truncated_gguf(tmp_path: Path, keep: float) -> None:
    data = _tiny_mamba(tmp_path / "ok.gguf").read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep
    p = tmp_path / "cut.gguf"
    p.write_bytes(data[:n])
    with pytest.raises(ModelFormatError, match=r"cut\.gguf"):
        rsmem.load_model(p)


def test_unsupported_arch_gguf(tmp_path: Path) -> None:
    p = _write_gguf(tmp_path / "llama.gguf", "llama", {"token_embd.weight": np.ones((4, 4), np.float32)}, {})
    with pytest.raises(ModelFormatError, match="unsupported architecture 'llama'"):
        rsmem.load_model(p)


def test_missing_tensor_gguf(tmp_path: Path) -> None:
    p = _tiny_mamba(tmp_path / "m.gguf", drop="blk.0.ssm_x.weight")
    with pytest.raises(ModelFormatError, match=r"blk\.0\.ssm_x\.weight"):
        rsmem.load_model(p)


def test_gguf_hyperparameter_that_is_not_a_number(tmp_path: Path) -> None:
    p = _tiny_mamba(tmp_path / "m.gguf", keys_over={"block_count": "one"})
    with pytest.raises(ModelFormatError, match=r"'mamba\.block_count' is 'one', not a number"):
        rsmem.load_model(p)


def test_gguf_vocabulary_that_is_not_strings(tmp_path: Path) -> None:
    bad = {"model": "gpt2", "tokens": list(range(16)), "token_type": [1] * 16, "merges": []}
    p = _tiny_mamba(tmp_path / "m.gguf", tokenizer=bad)
    with pytest.raises(ModelFormatError, match=r"'tokenizer\.ggml\.tokens' is not a list of strings"):
        rsmem.load_model(p)
    good = bad | {"tokens": [chr(ord("a") + i) for i in range(16)]}
    model = rsmem.load_model(_tiny_mamba(tmp_path / "ok.gguf", tokenizer=good))
    assert model.tokenizer is not None and model.tokenizer.encode("abc").ids == [0, 1, 2]


def test_hf_unsupported_arch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    with pytest.raises(ModelFormatError, match="unsupported architecture 'llama'"):
        rsmem.load_model(tmp_path)


def test_hf_missing_tensor(tmp_path: Path) -> None:
    cfg = {
        "model_type": "mamba",
        "hidden_size": 8,
        "num_hidden_layers": 1,
        "state_size": 4,
        "conv_kernel": 4,
        "intermediate_size": 16,
        "time_step_rank": 2,
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    save_file(
        {"backbone.embeddings.weight": np.ones((16, 8), np.float32)}, str(tmp_path / "model.safetensors")
    )
    with pytest.raises(ModelFormatError, match=r"missing tensor 'blk\.0\.attn_norm\.weight'"):
        rsmem.load_model(tmp_path)


def test_hf_folder_without_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mamba2"}))
    with pytest.raises(ModelFormatError, match=r"no model\.safetensors"):
        rsmem.load_model(tmp_path)
