"""Corrupt GGUF metadata: every value out of its range, a broken vocabulary or a truncated file is one
ModelFormatError naming the key or tensor (and one ``rsmem: error:`` line on the command line), never a
Python error from the arithmetic or the libraries underneath.

The files are copies of the llama.cpp fixtures with one value changed in place (gguf's reader writes
through its memory map, as llama.cpp's ``gguf_set_metadata.py`` does); the RWKV architectures, which have
no fixture file, get small files of their keys written here.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch  # noqa: F401  (imported before rsmem: see the note below)

from rsmem.errors import ModelFormatError
from rsmem.loaders import build_model, load_tokenizer, read_tensors

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
MAMBA = FIXTURES / "mamba" / "model-bf16.gguf"
# Note: when the first test module pytest imports imports rsmem before torch, test_llamacpp_fixtures'
# q8_0 logits fail ("Inplace update to inference tensor outside InferenceMode", in rsmem::qmatmul);
# importing torch first, as the other test modules do, avoids it. The cause lies outside the loaders.


def patched(tmp_path: Path, fixture: str, key: str, value: float, index: int = 0) -> Path:
    """A copy of ``fixture`` with metadata ``key`` (entry ``index`` of an array) set to ``value``."""
    path = tmp_path / f"{key}-{value}.gguf"
    shutil.copy(FIXTURES / fixture, path)
    reader = gguf.GGUFReader(path, "r+")
    field = reader.fields[key]
    field.parts[field.data[index]][0] = value
    reader.data.flush()
    del reader
    return path


CASES = [
    # the cases: a division by zero, and a model of no layers that loaded
    ("mamba2/model-bf16.gguf", "mamba2.ssm.group_count", 0,
     "'mamba2.ssm.group_count' is 0, must be at least 1"),
    ("mamba2/model-bf16.gguf", "mamba2.block_count", 0, "'mamba2.block_count' is 0, must be at least 1"),
    ("mamba/model-bf16.gguf", "mamba.block_count", 0, "'mamba.block_count' is 0, must be at least 1"),
    # a 0 that the configs took for "use the default"
    ("mamba/model-bf16.gguf", "mamba.ssm.inner_size", 0, "'mamba.ssm.inner_size' is 0"),
    ("mamba/model-bf16.gguf", "mamba.ssm.time_step_rank", 0, "'mamba.ssm.time_step_rank' is 0"),
    ("mamba2/model-bf16.gguf", "mamba2.ssm.inner_size", 0, "'mamba2.ssm.inner_size' is 0"),
    ("mamba2/model-q8_0.gguf", "mamba2.ssm.group_count", 3,
     "'mamba2.ssm.time_step_rank' (8) is not a multiple of 'mamba2.ssm.group_count' (3)"),
    ("lfm2/model-f32.gguf", "lfm2.attention.head_count", 0, "'lfm2.attention.head_count' is 0"),
    ("lfm2/model-f32.gguf", "lfm2.attention.head_count", 3,
     "'lfm2.embedding_length' (64) is not a multiple of 'lfm2.attention.head_count' (3)"),
    ("lfm2/model-f32.gguf", "lfm2.attention.head_count_kv", 3,
     "'lfm2.attention.head_count' (4) is not a multiple of 'lfm2.attention.head_count_kv' (3) in layer 1"),
    ("lfm2/model-f32.gguf", "lfm2.shortconv.l_cache", 1, "'lfm2.shortconv.l_cache' is 1, must be at least 2"),
    ("lfm2/model-f32.gguf", "lfm2.rope.freq_base", 0.0, "'lfm2.rope.freq_base' is 0.0, must be above 0"),
    ("lfm2/model-f32.gguf", "lfm2.attention.layer_norm_rms_epsilon", float("nan"),
     "'lfm2.attention.layer_norm_rms_epsilon' is nan, not a finite number"),
    ("nemotron_h/model-f32.gguf", "nemotron_h.ssm.time_step_rank", 0, "'nemotron_h.ssm.time_step_rank' is 0"),
    ("nemotron_h/model-f32.gguf", "nemotron_h.ssm.group_count", 0, "'nemotron_h.ssm.group_count' is 0"),
    ("nemotron_h/model-f32.gguf", "nemotron_h.attention.key_length", 0,
     "'nemotron_h.attention.key_length' is 0"),
    ("qwen35/model-f32.gguf", "qwen35.full_attention_interval", 0, None),  # unused: the layer flags rule
    ("qwen35/model-f32.gguf", "qwen35.attention.head_count_kv", 0, "'qwen35.attention.head_count_kv' is 0"),
    ("qwen35/model-f32.gguf", "qwen35.ssm.inner_size", 3,
     "'qwen35.ssm.inner_size' is 3, not ssm.time_step_rank x ssm.state_size (4 x 16 = 64)"),
    ("qwen35/model-f32.gguf", "qwen35.rope.dimension_count", 3,
     "'qwen35.rope.dimension_count' is 3, not even"),
]  # fmt: skip


@pytest.mark.parametrize(("fixture", "key", "value", "message"), CASES, ids=[f"{c[1]}={c[2]}" for c in CASES])
def test_a_value_out_of_its_range_names_its_key(
    tmp_path: Path, fixture: str, key: str, value: float, message: str | None
) -> None:
    index = 1 if key == "lfm2.attention.head_count_kv" else 0  # LFM2's layer 1 has attention
    path = patched(tmp_path, fixture, key, value, index)
    if message is None:
        read_tensors(path)
        return
    with pytest.raises(ModelFormatError, match=re.escape(f"{path}: metadata key {message}")):
        read_tensors(path)


def test_the_unmodified_fixtures_load() -> None:
    for fixture in ("mamba/model-bf16.gguf", "mamba2/model-q8_0.gguf", "lfm2/model-f32.gguf",
                    "nemotron_h/model-f32.gguf", "qwen35/model-f32.gguf"):  # fmt: skip
        read_tensors(FIXTURES / fixture)


# ------------------------------------------------------------------ RWKV (no fixture files)

RWKV_KEYS: dict[str, dict[str, int]] = {
    "rwkv7": {
        "embedding_length": 128, "block_count": 2, "wkv.head_size": 64, "feed_forward_length": 256,
        "attention.decay_lora_rank": 8, "attention.iclr_lora_rank": 8,
        "attention.value_residual_mix_lora_rank": 8, "attention.gate_lora_rank": 16,
    },
    "arwkv7": {
        "embedding_length": 128, "block_count": 2, "wkv.head_size": 64, "feed_forward_length": 256,
        "attention.decay_lora_rank": 8, "attention.iclr_lora_rank": 8,
        "attention.value_residual_mix_lora_rank": 8, "attention.gate_lora_rank": 0,
    },
    "rwkv6": {
        "embedding_length": 128, "block_count": 2, "wkv.head_size": 64, "feed_forward_length": 256,
        "time_mix_extra_dim": 32, "time_decay_extra_dim": 64, "rescale_every_n_layers": 0,
    },
    "rwkv6qwen2": {
        "embedding_length": 128, "block_count": 2, "wkv.head_size": 64, "feed_forward_length": 256,
        "time_mix_extra_dim": 32, "time_decay_extra_dim": 64, "attention.head_count_kv": 1,
    },
}  # fmt: skip


def rwkv_file(path: Path, arch: str, **changes: int) -> Path:
    """The architecture's keys and a token embedding: enough to read the config (the layers' tensors are
    missing, so a file whose keys are all in range fails on its first layer tensor)."""
    w = gguf.GGUFWriter(path, arch)
    for k, v in (RWKV_KEYS[arch] | changes).items():
        w.add_uint32(f"{arch}.{k}", v)
    w.add_tensor("token_embd.weight", np.zeros((16, 128), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


RWKV_CASES = [
    ("rwkv7", {"block_count": 0}, "'rwkv7.block_count' is 0, must be at least 1"),
    ("rwkv7", {"wkv.head_size": 48},
     "'rwkv7.embedding_length' (128) is not a multiple of 'rwkv7.wkv.head_size' (48)"),
    ("rwkv7", {"wkv.head_size": 0}, "'rwkv7.wkv.head_size' is 0"),
    ("rwkv7", {"attention.gate_lora_rank": 0}, "'rwkv7.attention.gate_lora_rank' is 0"),
    ("rwkv7", {"feed_forward_length": 0}, "'rwkv7.feed_forward_length' is 0"),
    ("arwkv7", {"attention.decay_lora_rank": 0}, "'arwkv7.attention.decay_lora_rank' is 0"),
    ("rwkv6", {"time_mix_extra_dim": 0}, "'rwkv6.time_mix_extra_dim' is 0"),
    ("rwkv6", {"embedding_length": 0}, "'rwkv6.embedding_length' is 0"),
    ("rwkv6qwen2", {"attention.head_count_kv": 0}, "'rwkv6qwen2.attention.head_count_kv' is 0"),
    ("rwkv6qwen2", {"attention.head_count_kv": 3},
     "'rwkv6qwen2.attention.head_count_kv' is 3, not a divisor"),
]  # fmt: skip


@pytest.mark.parametrize(("arch", "changes", "message"), RWKV_CASES, ids=[str(c[1]) for c in RWKV_CASES])
def test_rwkv_values_out_of_range_name_their_key(
    tmp_path: Path, arch: str, changes: dict[str, int], message: str
) -> None:
    with pytest.raises(ModelFormatError, match=re.escape(f"metadata key {message}")):
        read_tensors(rwkv_file(tmp_path / "m.gguf", arch, **changes))


@pytest.mark.parametrize("arch", sorted(RWKV_KEYS))
def test_rwkv_keys_in_range_pass_to_the_tensors(tmp_path: Path, arch: str) -> None:
    ckpt = read_tensors(rwkv_file(tmp_path / "m.gguf", arch))
    with pytest.raises(ModelFormatError, match=r"blk\.0\.|layer 0"):  # its first layer's tensors
        build_model(ckpt)


# ------------------------------------------------------------------ vocabulary, truncation, the CLI


def test_a_flipped_bit_in_the_merges_names_the_merge(tmp_path: Path) -> None:
    data = bytearray(MAMBA.read_bytes())
    reader = gguf.GGUFReader(MAMBA)
    field = reader.fields["tokenizer.ggml.merges"]
    at = field.offset + data[field.offset :].index(b"s e")  # the merge "s e" (of the vocabulary's "se")
    data[at] ^= 0x20  # "S e": "Se" is no token
    path = tmp_path / "merges.gguf"
    path.write_bytes(bytes(data))
    pattern = r"merges\.gguf: BPE merge \d+ \('S e'\) of 'tokenizer\.ggml\.merges' needs 'Se'"
    with pytest.raises(ModelFormatError, match=pattern):
        load_tokenizer(path)


def test_a_special_token_outside_the_vocabulary_names_its_key(tmp_path: Path) -> None:
    path = patched(tmp_path, "mamba/model-bf16.gguf", "tokenizer.ggml.eos_token_id", 60000)
    with pytest.raises(
        ModelFormatError, match=r"'tokenizer\.ggml\.eos_token_id' is 60000, outside the vocabulary"
    ):
        read_tensors(path)


def _cut(tmp_path: Path, n: int) -> Path:
    path = tmp_path / f"cut{n}.gguf"
    path.write_bytes(MAMBA.read_bytes()[:n])
    return path


def test_a_file_cut_in_its_metadata_says_where(tmp_path: Path) -> None:
    field = gguf.GGUFReader(MAMBA).fields["tokenizer.ggml.merges"]
    path = _cut(tmp_path, field.offset + 100)  # inside the merges
    pattern = (
        r"truncated or corrupt GGUF file: the metadata after key 'tokenizer\.ggml\.token_type' needs bytes "
        rf"\d+ to \d+, past the end of the file \({field.offset + 100} bytes\)"
    )
    with pytest.raises(ModelFormatError, match=pattern) as caught:
        read_tensors(path)
    assert "dtype" not in str(caught.value)  # none of numpy's words


def test_a_file_cut_in_a_tensor_names_it(tmp_path: Path) -> None:
    tensor = next(t for t in gguf.GGUFReader(MAMBA).tensors if t.name == "blk.0.ssm_a")
    path = _cut(tmp_path, tensor.data_offset + 6)  # 6 bytes into float32 values: not whole values
    pattern = r"tensor 'blk\.0\.ssm_a' is truncated or corrupt: its data needs bytes \d+ to \d+, past the end"
    with pytest.raises(ModelFormatError, match=pattern) as caught:
        read_tensors(path)
    assert "dtype" not in str(caught.value)


@pytest.mark.subprocess
def test_the_cli_reports_a_corrupt_file_in_one_line(tmp_path: Path) -> None:
    path = patched(tmp_path, "mamba2/model-bf16.gguf", "mamba2.ssm.group_count", 0)
    r = subprocess.run(
        [sys.executable, "-m", "rsmem.cli", "generate", "-m", str(path), "-p", "hi", "-n", "2"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 1
    assert r.stdout == ""
    assert r.stderr.splitlines() == [
        f"rsmem: error: {path}: metadata key 'mamba2.ssm.group_count' is 0, must be at least 1"
    ]


def test_an_hf_group_count_of_zero_names_it(tmp_path: Path) -> None:
    folder = tmp_path / "hf"
    shutil.copytree(FIXTURES / "mamba2" / "hf", folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config | {"n_groups": 0}))
    with pytest.raises(ModelFormatError, match=r"hf/config\.json: n_groups 0 does not split"):
        read_tensors(folder)
