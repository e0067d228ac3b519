"""``rsmem quantize``: write a GGUF file's tensors in another type, as llama.cpp's ``llama-quantize`` does.

:func:`quantize_gguf` reads any GGUF file rsmem reads (f32/f16/bf16, or already quantized: those tensors are
dequantized first, as llama.cpp does with ``--allow-requantize``) and writes a new one:

- every metadata key copied byte for byte, in order, except ``general.quantization_version`` and
  ``general.file_type``, written anew at the end (and the split keys, dropped), as llama.cpp does;
- the tensors in llama.cpp's order (:func:`quant_rules.llama_order`), each typed by llama.cpp's rules
  (:mod:`rsmem.loaders.quant_rules`); a tensor whose type does not change is copied unchanged;
- the quantizers: gguf-py's for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 and BF16 (written from ggml's reference
  functions), :mod:`rsmem.loaders.kquants` for Q2_K ... Q6_K, numpy's for F16.

The layout (header, tensor table, alignment padding after the table and after every tensor) is ggml's, so
for an f32 source the file is byte for byte the one llama.cpp writes (tests/quantize/ checks every preset).
The file is written to a temporary name beside ``dst`` and renamed when complete.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import gguf
import numpy as np

from rsmem.errors import ModelFormatError
from rsmem.loaders.kquants import QUANTIZERS as K_QUANTIZERS
from rsmem.loaders.quant_rules import (
    PRESETS,
    ModelInfo,
    Preset,
    TensorSpec,
    ggml_n_dims,
    llama_order,
    target_types,
)
from rsmem.loaders.tensor_types import open_reader

Q = gguf.GGMLQuantizationType
GGUF_VERSION = 3
CHUNK_VALUES = 1 << 17  # values quantized at a time: the K-quants run fastest with ~1 MB temporaries
_DROPPED_KEYS = ("split.no", "split.count", "split.tensors.count")
_REWRITTEN_KEYS = ("general.quantization_version", "general.file_type")
_GGUF_UINT32 = 4  # GGUFValueType.UINT32


def quantize_types() -> list[str]:
    """The ``--type`` names :func:`quantize_gguf` accepts."""
    return list(PRESETS)


def preset(ftype: str) -> Preset:
    """The preset named ``ftype`` (case-insensitive); ValueError lists the valid names."""
    p = PRESETS.get(ftype.lower())
    if p is None:
        raise ValueError(f"unknown quantization type {ftype!r}; valid types: {', '.join(PRESETS)}")
    return p


@dataclass(frozen=True, slots=True)
class _Planned:
    tensor: gguf.ReaderTensor
    ne: tuple[int, ...]
    qtype: gguf.GGMLQuantizationType
    nbytes: int


def quantize_gguf(src: str | os.PathLike[str], dst: str | os.PathLike[str], ftype: str) -> Path:
    """Write ``src``'s model to ``dst`` with its tensors in the preset ``ftype`` (see
    :func:`quantize_types`); returns ``dst``. ModelFormatError if ``src`` is not a readable GGUF file,
    ValueError for an unknown ``ftype``, FileNotFoundError for a missing ``src``."""
    p = preset(ftype)
    src, dst = Path(src), Path(dst)
    if not src.is_file():
        raise FileNotFoundError(f"{src}: no such file")
    if src.resolve() == dst.resolve():
        raise ValueError(f"{dst}: the output must not be the input file")
    reader = _open(src)
    plan = _plan(reader, p, src)
    tmp = dst.with_name(f".{dst.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            _write(f, reader, p, plan)
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)
    return dst


def _open(src: Path) -> gguf.GGUFReader:
    try:
        reader = open_reader(src)
    except ModelFormatError:
        raise
    except Exception as exc:  # the reader raises many types on truncated or corrupt files
        raise ModelFormatError(f"{src}: unreadable GGUF file ({type(exc).__name__}: {exc})") from exc
    if reader.byte_order != "I":
        raise ModelFormatError(f"{src}: big-endian GGUF files are not supported")
    return reader


def _model_info(reader: gguf.GGUFReader) -> ModelInfo:
    """The block count and layer 0's ``head_count / head_count_kv`` (a key may be one number or one per
    layer; KV heads default to the heads), as llama.cpp's loader reads them."""
    arch_field = reader.fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else ""

    def first(key: str) -> int | None:
        field = reader.fields.get(f"{arch}.{key}")
        value = field.contents() if field is not None else None
        if isinstance(value, list):
            value = value[0] if value else None
        return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None

    n_head = first("attention.head_count") or 0
    n_kv = first("attention.head_count_kv")
    n_kv = n_head if n_kv is None else n_kv
    return ModelInfo(n_layer=first("block_count") or 0, n_gqa=n_head // n_kv if n_kv else 0)


def _plan(reader: gguf.GGUFReader, p: Preset, src: Path) -> list[_Planned]:
    by_name = {t.name: t for t in reader.tensors}
    specs = [
        TensorSpec(name, tuple(int(d) for d in by_name[name].shape), by_name[name].tensor_type)
        for name in llama_order(list(by_name))
    ]
    types = target_types(p, specs, _model_info(reader))
    plan = []
    for spec in specs:
        qtype = types[spec.name]
        if qtype != spec.type and spec.type not in _READABLE:
            raise ModelFormatError(
                f"{src}: tensor {spec.name!r} has type {spec.type.name}, which cannot be requantized"
            )
        block, type_size = gguf.GGML_QUANT_SIZES[qtype]
        n = int(np.prod(spec.ne))
        plan.append(_Planned(by_name[spec.name], spec.ne, qtype, n // block * type_size))
    return plan


def _pad(n: int, align: int) -> int:
    return -(n // -align) * align


def _string(s: bytes) -> bytes:
    return struct.pack("<Q", len(s)) + s


def _metadata(reader: gguf.GGUFReader, p: Preset) -> list[bytes]:
    """Each key/value pair as the file stores it: the source's raw bytes, then the two rewritten keys."""
    kvs = []
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in _DROPPED_KEYS or name in _REWRITTEN_KEYS:
            continue
        kvs.append(b"".join(part.tobytes() for part in field.parts))
    for key, value in zip(_REWRITTEN_KEYS, (gguf.GGML_QUANT_VERSION, int(p.file_type))):
        kvs.append(_string(key.encode()) + struct.pack("<II", _GGUF_UINT32, value))
    return kvs


def _write(f: BinaryIO, reader: gguf.GGUFReader, p: Preset, plan: list[_Planned]) -> None:
    align = int(reader.alignment)
    kvs = _metadata(reader, p)
    header = [b"GGUF", struct.pack("<IQQ", GGUF_VERSION, len(plan), len(kvs)), *kvs]
    offset = 0
    for item in plan:
        ne = item.ne[: ggml_n_dims(item.ne)]
        header.append(_string(item.tensor.name.encode()))
        header.append(struct.pack(f"<I{len(ne)}qIQ", len(ne), *ne, int(item.qtype), offset))
        offset += _pad(item.nbytes, align)
    head = b"".join(header)
    f.write(head + bytes(_pad(len(head), align) - len(head)))
    for item in plan:
        written = 0
        for chunk in _tensor_bytes(item):
            f.write(chunk)
            written += len(chunk)
        if written != item.nbytes:  # a quantizer's shape bug must not shift every later tensor
            raise AssertionError(f"tensor {item.tensor.name!r}: wrote {written} bytes, planned {item.nbytes}")
        f.write(bytes(_pad(written, align) - written))


def _tensor_bytes(item: _Planned) -> Iterator[bytes]:
    t = item.tensor
    if item.qtype == t.tensor_type:
        yield t.data.tobytes()
        return
    row = item.ne[0]
    raw = np.ascontiguousarray(t.data).view(np.uint8).reshape(-1)
    src_block, src_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    src_row = row // src_block * src_size
    n_rows = raw.size // src_row
    quantize = _quantizer(item.qtype)
    step = max(1, CHUNK_VALUES // row)
    for r in range(0, n_rows, step):
        rows = raw[r * src_row : min(n_rows, r + step) * src_row].reshape(-1, src_row)
        yield quantize(_to_f32(rows, t.tensor_type)).tobytes()


def _to_f32(rows: np.ndarray, qtype: gguf.GGMLQuantizationType) -> np.ndarray:
    """Raw rows of ``qtype`` as float32 (ggml's to_float: exact for F16/BF16, the reference dequantizers)."""
    if qtype == Q.F32:
        return rows.view(np.float32)
    if qtype == Q.F64:
        return rows.view(np.float64).astype(np.float32)
    return gguf.quants.dequantize(rows, qtype)


def _quantizer(qtype: gguf.GGMLQuantizationType) -> Callable[[np.ndarray], np.ndarray]:
    if qtype in K_QUANTIZERS:
        return K_QUANTIZERS[qtype]
    if qtype == Q.F32:
        return lambda x: np.ascontiguousarray(x, dtype=np.float32)
    if qtype == Q.F16:
        return lambda x: x.astype(np.float16)
    return lambda x: gguf.quants.quantize(x, qtype)


def _readable() -> frozenset[gguf.GGMLQuantizationType]:
    """Source types :func:`_to_f32` converts (gguf-py dequantizes them), asked with one zero block."""
    out = {Q.F32, Q.F16, Q.BF16, Q.F64}
    for t in Q:
        block, size = gguf.GGML_QUANT_SIZES[t]
        if block == 1:
            continue
        try:
            gguf.quants.dequantize(np.zeros((1, size), np.uint8), t)
        except NotImplementedError:
            continue
        out.add(t)
    return frozenset(out)


_READABLE = _readable()


def convert_then_quantize(
    write_f32: Callable[[Path], object], dst: str | os.PathLike[str], ftype: str
) -> Path:
    """For converters: ``write_f32(path)`` writes an f32 GGUF file (to a temporary name beside ``dst``),
    which is quantized to ``dst`` in the preset ``ftype`` and removed; returns ``dst``."""
    preset(ftype)  # an unknown type fails before the conversion
    dst = Path(dst)
    tmp = dst.with_name(f".{dst.name}.f32.tmp{os.getpid()}")
    try:
        write_f32(tmp)
        return quantize_gguf(tmp, dst, ftype)
    finally:
        tmp.unlink(missing_ok=True)
