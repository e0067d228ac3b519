"""Tiny f32 Mamba and Mamba-2 GGUF files whose every value comes from integer arithmetic (no RNG), so a
test rebuilds the exact file llama.cpp quantized for tests/fixtures/quantize/ (its sha256 is recorded there).

Rows are 256 wide where the layout allows (the K-quants' super-block), with a few rows made to reach the
quantizers' corner cases: an all-zero row, a constant row, a row with one large outlier, a row whose first
32 values are 1e-4 of the rest (a Q4_K sub-block whose 6-bit scale rounds to 0), all-negative and
all-positive rows. Mamba's ``ssm_dt.weight`` has 16-wide rows, which no quantized type fits (llama.cpp's
fallback writes it F16).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import gguf
import numpy as np

N_EMBD = 256
D_INNER = 256
D_STATE = 16
D_CONV = 4
N_VOCAB = 32
N_HEAD = 4  # Mamba-2
DT_RANK = 16  # Mamba
EPS = 1e-5
ARCHS = ("mamba", "mamba2")
# keys of every value type, copied unchanged by a quantizer (besides the model's own)
EXTRA_KEYS = {
    "general.name": "rsmem-quant-fixture",
    "general.description": "tiny random model for quantizer tests",
}


def values(n: int, seed: int) -> np.ndarray:
    """``n`` float32 values in [-1, 1) from splitmix64 of (seed, index): the same on every platform."""
    with np.errstate(over="ignore"):
        z = np.arange(n, dtype=np.uint64) + np.uint64(seed) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    top = (z >> np.uint64(40)).astype(np.float32)  # 24 bits
    return top / np.float32(2**23) - np.float32(1.0)


def matrix(rows: int, cols: int, seed: int, scale: float) -> np.ndarray:
    return (values(rows * cols, seed) * np.float32(scale)).reshape(rows, cols)


def with_corner_rows(m: np.ndarray) -> np.ndarray:
    """The matrix with its first rows replaced by the quantizers' corner cases (see the module doc)."""
    m = m.copy()
    m[0] = 0.0
    m[1] = np.float32(0.01)
    m[2, 7] = np.float32(50.0) * np.abs(m[2]).max()
    m[3, :32] *= np.float32(1e-4)
    m[4] = -np.abs(m[4])
    m[5] = np.abs(m[5]) + np.float32(0.02)
    return m


def tensors(arch: str) -> dict[str, np.ndarray]:
    """The model's tensors by GGUF name, numpy order (a Linear weight reads ``[out, in]``)."""
    emb = matrix(N_VOCAB, N_EMBD, 1, 0.5)
    t: dict[str, np.ndarray] = {"token_embd.weight": emb}
    if arch == "mamba":
        t["blk.0.ssm_in.weight"] = with_corner_rows(matrix(2 * D_INNER, N_EMBD, 2, 0.08))
        t["blk.0.ssm_conv1d.weight"] = matrix(D_INNER, D_CONV, 3, 0.4)
        t["blk.0.ssm_conv1d.bias"] = matrix(1, D_INNER, 4, 0.1)[0]
        t["blk.0.ssm_x.weight"] = matrix(DT_RANK + 2 * D_STATE, D_INNER, 5, 0.08)
        t["blk.0.ssm_dt.weight"] = matrix(D_INNER, DT_RANK, 6, 0.2)
        t["blk.0.ssm_dt.bias"] = matrix(1, D_INNER, 7, 0.5)[0] - np.float32(2.0)
        a = np.tile(np.arange(1, D_STATE + 1, dtype=np.float32), (D_INNER, 1))
        t["blk.0.ssm_a"] = -a
        t["blk.0.ssm_d"] = np.ones(D_INNER, np.float32)
        t["blk.0.ssm_out.weight"] = matrix(N_EMBD, D_INNER, 8, 0.08)
        t["output.weight"] = matrix(N_VOCAB, N_EMBD, 9, 0.5)  # untied: token_embd keeps the default type
    else:
        conv_dim = D_INNER + 2 * D_STATE
        t["blk.0.ssm_in.weight"] = with_corner_rows(
            matrix(2 * D_INNER + 2 * D_STATE + N_HEAD, N_EMBD, 2, 0.08)
        )
        t["blk.0.ssm_conv1d.weight"] = matrix(conv_dim, D_CONV, 3, 0.4)
        t["blk.0.ssm_conv1d.bias"] = matrix(1, conv_dim, 4, 0.1)[0]
        t["blk.0.ssm_dt.bias"] = matrix(1, N_HEAD, 7, 0.5)[0] - np.float32(2.0)
        t["blk.0.ssm_a"] = -np.arange(1, N_HEAD + 1, dtype=np.float32).reshape(N_HEAD, 1)
        t["blk.0.ssm_d"] = np.ones((N_HEAD, 1), np.float32)
        t["blk.0.ssm_norm.weight"] = np.ones((1, D_INNER), np.float32)
        t["blk.0.ssm_out.weight"] = matrix(N_EMBD, D_INNER, 8, 0.08)
    t["blk.0.attn_norm.weight"] = np.ones(N_EMBD, np.float32)
    t["output_norm.weight"] = np.ones(N_EMBD, np.float32)
    return t


def write_model(arch: str, path: Path) -> Path:
    """Write the tiny f32 model of ``arch`` ("mamba" or "mamba2") to ``path``."""
    w = gguf.GGUFWriter(path, arch)
    w.add_name(EXTRA_KEYS["general.name"])
    w.add_description(EXTRA_KEYS["general.description"])
    w.add_context_length(2**20)
    w.add_embedding_length(N_EMBD)
    w.add_feed_forward_length(0)
    w.add_head_count(0)
    w.add_block_count(1)
    w.add_ssm_conv_kernel(D_CONV)
    w.add_ssm_inner_size(D_INNER)
    w.add_ssm_state_size(D_STATE)
    if arch == "mamba":
        w.add_ssm_time_step_rank(DT_RANK)
        w.add_ssm_dt_b_c_rms(False)
    else:
        w.add_ssm_time_step_rank(N_HEAD)
        w.add_ssm_group_count(1)
    w.add_layer_norm_rms_eps(EPS)
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_tokenizer_model("none")
    # one key of each other value type a file may hold
    w.add_array("rsmem.test.floats", [0.5, -1.25, 3.0])
    w.add_array("rsmem.test.strings", ["a", "bc", ""])
    w.add_bool("rsmem.test.flag", True)
    w.add_uint64("rsmem.test.u64", 2**40 + 3)
    w.add_int8("rsmem.test.i8", -5)
    w.add_float64("rsmem.test.f64", 0.1)
    for name, data in tensors(arch).items():
        w.add_tensor(name, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def describe(path: Path) -> dict[str, object]:
    """A GGUF file's size and sha256, and per tensor (in file order) its type and the first 16 hex digits of
    its bytes' sha256: what tests/fixtures/quantize/llamacpp.json records of llama.cpp's files."""
    reader = gguf.GGUFReader(path)
    return {
        "size": path.stat().st_size,
        "sha256": sha256(path.read_bytes()),
        "tensors": {t.name: [t.tensor_type.name, sha256(t.data.tobytes())[:16]] for t in reader.tensors},
    }
