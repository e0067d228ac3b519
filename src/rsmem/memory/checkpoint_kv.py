"""Rows in checkpoint files (:mod:`rsmem.memory.checkpoint_file`): one array's bytes in each codec, and
the KV part a hybrid memory's checkpoint adds (version 2 files).

KV layout, little-endian, in the header after the recurrent widths::

    u32 kv type (ggml: 0 F32, 1 F16, 30 BF16)     u32 n_kv
    n_kv x (u32 layer, u32 n_embd_k, u32 n_embd_v)  the cache's attention layers, ascending

and in each record after the recurrent rows::

    u32 n_pos, n_pos x i32 positions              ascending (equal allowed), 0 <= p <= the record's pos
    per attention layer: its K rows [n_pos, n_embd_k], then its V rows [n_pos, n_embd_v], each one
        array in the record's codec (exact: the kv type; bf16; int8 blocks of 32 then f32 scales)
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable, Sequence

import torch

from rsmem.errors import StateFormatError
from rsmem.memory.checkpoint import INT8_BLOCK, Encoded, KVRows

KVDims = tuple[tuple[int, int, int], ...]  # (layer, n_embd_k, n_embd_v) per attention layer
MAX_KV_LAYERS = 1 << 16


# ---------------------------------------------------------------- one array


def array_sizes(width: int, codec: str, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one array of ``width`` values: its data and its scales in ``codec``."""
    if codec == "exact":
        return width * torch.finfo(dtype).bits // 8, 0
    if codec == "bf16":
        return width * 2, 0
    blocks = -(-width // INT8_BLOCK)
    return blocks * INT8_BLOCK, blocks * 4


def decode_array(
    raw: memoryview, width: int, d_bytes: int, codec: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One array's data (``[1, width]``, or int8 blocks ``[n, 32]``) and scales from its bytes."""
    buf = bytearray(raw)
    if d_bytes == 0:  # no values (a KV part without positions)
        empty = (
            torch.empty(0, INT8_BLOCK, dtype=torch.int8)
            if codec == "int8"
            else torch.empty(1, 0, dtype=dtype)
        )
        return empty, torch.empty(0) if codec == "int8" else None
    if codec == "int8":
        data = torch.frombuffer(buf[:d_bytes], dtype=torch.int8).view(-1, INT8_BLOCK)
        return data, torch.frombuffer(buf[d_bytes:], dtype=torch.float32)
    stored = dtype if codec == "exact" else torch.bfloat16
    return torch.frombuffer(buf, dtype=stored).view(1, width), None


def tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())


def encoded_bytes(e: Encoded) -> bytes:
    return tensor_bytes(e.data) + (b"" if e.scales is None else tensor_bytes(e.scales))


# ---------------------------------------------------------------- the KV part


def pack_dims(kv_type: int, dims: KVDims) -> bytes:
    flat = [v for d in dims for v in d]
    return struct.pack(f"<II{len(flat)}I", kv_type, len(dims), *flat)


def read_dims(take: Callable[[int, str], Sequence[int]]) -> tuple[int, KVDims]:
    """The header's KV part through ``take(n_u32, what)`` (u32 values)."""
    kv_type, n = take(2, "the KV layout")
    if n > MAX_KV_LAYERS:
        raise StateFormatError(f"corrupt header: {n} attention layers")
    flat = take(3 * n, "the KV layer widths")
    return int(kv_type), tuple(
        (int(flat[3 * i]), int(flat[3 * i + 1]), int(flat[3 * i + 2])) for i in range(n)
    )


def kv_size(dims: KVDims, n_pos: int, codec: str, dtype: torch.dtype) -> int:
    """Bytes of a record's KV part holding ``n_pos`` positions."""
    arrays = [n_pos * w for _, dk, dv in dims for w in (dk, dv)]
    return 4 + 4 * n_pos + sum(sum(array_sizes(w, codec, dtype)) for w in arrays)


def kv_record_bytes(kv: KVRows, dims: KVDims) -> bytes:
    """A record's KV part for ``kv`` (ValueError when it does not fit ``dims``)."""
    n = len(kv.positions)
    if len(kv.k) != len(dims) or len(kv.v) != len(dims):
        raise ValueError("the checkpoint's KV rows do not fit this layout")
    for (_, dk, dv), k, v in zip(dims, kv.k, kv.v, strict=True):
        if tuple(k.shape) != (n, dk) or tuple(v.shape) != (n, dv):
            raise ValueError("the checkpoint's KV rows do not fit this layout")
    parts = [struct.pack(f"<I{n}i", n, *kv.positions)]
    parts += [encoded_bytes(e) for k, v in zip(kv.k, kv.v, strict=True) for e in (k, v)]
    return b"".join(parts)


def parse_kv(
    body: memoryview, offset: int, dims: KVDims, codec: str, dtype: torch.dtype, pos: int, what: str
) -> KVRows:
    """The KV part of a record's ``body`` from ``offset`` to its end, checked: its size, positions
    ascending within ``[0, pos]``, finite rows. StateFormatError naming ``what`` when it fails."""
    if len(body) - offset < 4:
        raise StateFormatError(f"{what}: truncated before its KV rows")
    (n,) = struct.unpack_from("<I", body, offset)
    if len(body) - offset != kv_size(dims, n, codec, dtype):
        raise StateFormatError(
            f"{what}: {len(body) - offset} bytes of KV rows, {n} positions need another size"
        )
    positions = struct.unpack_from(f"<{n}i", body, offset + 4)
    if any(b < a for a, b in itertools.pairwise(positions)) or (
        positions and (positions[0] < 0 or positions[-1] > pos)
    ):
        raise StateFormatError(f"{what}: KV positions not ascending within 0..{pos}")
    at = offset + 4 + 4 * n
    k: list[Encoded] = []
    v: list[Encoded] = []
    for _, dk, dv in dims:
        for width, out in ((dk, k), (dv, v)):
            d_bytes, s_bytes = array_sizes(n * width, codec, dtype)
            data, scales = decode_array(body[at : at + d_bytes + s_bytes], n * width, d_bytes, codec, dtype)
            if not bool(torch.isfinite(data.to(torch.float32) if scales is None else scales).all()):
                raise StateFormatError(f"{what}: KV rows hold NaN or inf")
            out.append(
                Encoded(data if scales is not None else data.view(n, width), scales, (n, width), dtype)
            )
            at += d_bytes + s_bytes
    return KVRows(tuple(int(p) for p in positions), tuple(k), tuple(v))
