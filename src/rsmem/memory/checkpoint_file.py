"""Checkpoint files: the checkpoints of a saved sequence, and prefix-cache entries kept on disk.

A llama.cpp sequence file (``.ggsq``, :mod:`rsmem.memory.state_io`) holds one state: the sequence's
newest. The checkpoints of that sequence (its state after shorter prefixes of the same tokens, see
:mod:`rsmem.memory.checkpoint`) go in a **companion** file next to it, ``<name>.ckpt``, so the ``.ggsq``
stays byte for byte what llama.cpp writes and reads. A prefix cache kept on disk (``--cache-dir``) stores
each checkpoint in an **entry** file of the same format, with its key tokens in the header.

Layout, little-endian::

    header
      u32 magic 0x6b637372 ('rsck')    u32 version (1; 2: a hybrid memory's, with KV rows)
      u32 kind (1: companion, 2: entry)
      u32 state type (ggml: 0 F32, 1 F16, 30 BF16)         u32 n_layer
      n_layer x (u32 r_width, u32 s_width)                 values per row; 0: the layer keeps no rows
      version 2: the KV layout (:mod:`rsmem.memory.checkpoint_kv`)
      32 bytes model fingerprint                           (:func:`model_fingerprint`)
      u32 n_key, 32 bytes sha256 of the key tokens (u32 each)
          companion: the key is the sequence file's tokens (not repeated here)
          entry: the key is the checkpoint's tokens, which follow: n_key x u32
      u32 n_records
      u32 crc32 of the header bytes above
    n_records x record
      u64 size                         bytes after this field, through the crc
      u32 n_tokens                     the state after key[:n_tokens] (1 <= n_tokens <= n_key)
      i32 pos                          the position of its last token (the cell's pos when restored)
      u32 codec (0 exact, 1 bf16, 2 int8)
      rows: every layer's r row, then every layer's s row (layers without rows skipped), each
          exact: width values of the state type;  bf16: width bf16 values;
          int8: ceil(width/32) blocks of 32 int8, then as many f32 scales (value = q * scale)
      version 2: the KV rows (positions, then each attention layer's K and V rows in the codec)
      u32 crc32 of the record from n_tokens through the rows

Every size follows from the header and the codec, and is checked. Reading is two-phase:
:func:`parse_file` checks every field (magic, version, kind, the memory's shape, the model fingerprint,
the key, each record's size, checksum and finite rows) and decodes the records into
:class:`~rsmem.memory.checkpoint.Checkpoint` objects without touching anything; the caller applies them
only when all of it parsed. Any failure is a :class:`CheckpointFileError` naming what is wrong.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from rsmem.errors import StateFormatError
from rsmem.memory.checkpoint import Checkpoint, Encoded
from rsmem.memory.checkpoint_kv import (
    KVDims,
    array_sizes,
    decode_array,
    kv_record_bytes,
    kv_size,
    pack_dims,
    parse_kv,
    read_dims,
    tensor_bytes,
)
from rsmem.memory.hybrid import HybridMemory
from rsmem.memory.recurrent import RecurrentMemory
from rsmem.memory.state_io import DTYPE_OF_GGML_TYPE, GGML_TYPE_NAMES, GGML_TYPE_OF_DTYPE, Reader

MAGIC = 0x6B637372  # b"rsck" as a little-endian u32
VERSION = 1  # recurrent memories; a hybrid memory's files are version 2 (with KV rows)
VERSION_KV = 2
KIND_COMPANION = 1
KIND_ENTRY = 2
CODEC_IDS = {"exact": 0, "bf16": 1, "int8": 2}
CODEC_NAMES = {v: k for k, v in CODEC_IDS.items()}
DIGEST_BYTES = 32
MAX_LAYERS = 1 << 16
MAX_KEY_TOKENS = 1 << 24


class CheckpointFileError(StateFormatError):
    """A checkpoint file is truncated, corrupt, or belongs to another model, memory or sequence."""


@dataclass(frozen=True, slots=True)
class Layout:
    """The shape of one sequence's state: the state type and each layer's (r, s) row widths; a hybrid
    memory's also the KV cache's type and its attention layers' (layer, n_embd_k, n_embd_v)."""

    state_type: int
    widths: tuple[tuple[int, int], ...]
    kv_type: int = 0
    kv: KVDims = ()

    @classmethod
    def of(cls, memory: RecurrentMemory | HybridMemory) -> Layout:
        def width(t: torch.Tensor | None) -> int:
            return 0 if t is None else int(t.shape[1])

        recurrent = memory.recurrent if isinstance(memory, HybridMemory) else memory
        widths = tuple((width(r), width(s)) for r, s in zip(recurrent.r_l, recurrent.s_l, strict=True))
        if not isinstance(memory, HybridMemory):
            return cls(GGML_TYPE_OF_DTYPE[recurrent.dtype], widths)
        dims = tuple((il, dk, dv) for il, (dk, dv) in memory.kv.layer_dims.items())
        return cls(GGML_TYPE_OF_DTYPE[recurrent.dtype], widths, GGML_TYPE_OF_DTYPE[memory.kv.dtype], dims)

    @property
    def version(self) -> int:
        return VERSION_KV if self.kv else VERSION

    @property
    def kv_dtype(self) -> torch.dtype:
        return DTYPE_OF_GGML_TYPE[self.kv_type]

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE_OF_GGML_TYPE[self.state_type]

    def arrays(self) -> list[int]:
        """The widths of the rows a record holds, in order (r rows of every layer, then s rows)."""
        return [w for w, _ in self.widths if w] + [w for _, w in self.widths if w]

    def pack(self) -> bytes:
        flat = [v for pair in self.widths for v in pair]
        head = struct.pack(f"<II{len(flat)}I", self.state_type, len(self.widths), *flat)
        return head + (pack_dims(self.kv_type, self.kv) if self.kv else b"")


@dataclass(frozen=True, slots=True)
class Header:
    kind: int
    layout: Layout
    fingerprint: bytes
    n_key: int
    key_digest: bytes
    key_tokens: tuple[int, ...]  # entry files only
    n_records: int
    size: int  # bytes, through the header's crc


def token_digest(tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(struct.pack(f"<{len(tokens)}I", *tokens)).digest()


def model_fingerprint(model: object, layout: Layout) -> bytes:
    """32 bytes that differ between models whose checkpoints must not mix: the architecture, sizes and
    compute dtype, the memory's layout, and a grid of values sampled from the embedding, the final norm
    and every layer's matrices (``model.matrices`` of ``model.layers``) where the model has them (else
    its sizes alone); wrappers with ``inner``, such as ``FaultyModel``, are seen through."""
    while hasattr(model, "inner"):
        model = model.inner
    h = hashlib.sha256()
    names = ("arch", "n_vocab", "n_layer", "n_embd_r", "n_embd_s", "dtype")
    h.update("|".join(f"{n}={getattr(model, n, None)}" for n in names).encode())
    h.update(layout.pack())
    tensors = [(name, getattr(model, name, None)) for name in ("embedding", "norm_f")]
    for il, layer in enumerate(getattr(model, "layers", None) or ()):
        tensors += [(f"{il}.{name}", getattr(layer, name, None)) for name in getattr(model, "matrices", ())]
    for name, t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            h.update(f"{name}{tuple(t.shape)}".encode())
            h.update(_sample(t.detach()).to(torch.float32).cpu().numpy().tobytes())
    return h.digest()


def _sample(t: torch.Tensor, k: int = 64) -> torch.Tensor:
    """Up to ``k`` evenly spaced indices along each dimension (integer steps: a float linspace rounds past
    the end of large tensors), gathered without copying the tensor (a held matrix may be a strided view)."""
    idx = []
    for size in t.shape:
        n = min(size, k)
        idx.append(torch.arange(n, dtype=torch.int64, device=t.device) * (size - 1) // max(n - 1, 1))
    return t[torch.meshgrid(*idx, indexing="ij")] if idx else t


# ---------------------------------------------------------------- writing


def companion_bytes(
    layout: Layout, fingerprint: bytes, tokens: Sequence[int], records: Sequence[tuple[int, Checkpoint]]
) -> bytes:
    """A companion of a sequence file holding ``tokens``: ``records`` are (n_tokens, checkpoint)."""
    head = _header_bytes(KIND_COMPANION, layout, fingerprint, tokens, len(records), store_key=False)
    return head + b"".join(_record_bytes(layout, n, c, len(tokens)) for n, c in records)


def entry_bytes(layout: Layout, fingerprint: bytes, tokens: Sequence[int], ckpt: Checkpoint) -> bytes:
    """One prefix-cache entry: the checkpoint after ``tokens``, with the tokens."""
    head = _header_bytes(KIND_ENTRY, layout, fingerprint, tokens, 1, store_key=True)
    return head + _record_bytes(layout, len(tokens), ckpt, len(tokens))


def entry_size(layout: Layout, n_tokens: int, codec: str, n_kv_positions: int = 0) -> int:
    """The bytes :func:`entry_bytes` writes for a key of ``n_tokens`` tokens in ``codec`` (a hybrid's
    checkpoint holding ``n_kv_positions`` KV positions)."""
    header = len(layout.pack()) + 12 + DIGEST_BYTES + 4 + DIGEST_BYTES + 4 * n_tokens + 8
    rows = sum(d + s for d, s in (array_sizes(w, codec, layout.dtype) for w in layout.arrays()))
    kv = kv_size(layout.kv, n_kv_positions, codec, layout.kv_dtype) if layout.kv else 0
    return header + 8 + 12 + rows + kv + 4


def _header_bytes(
    kind: int, layout: Layout, fingerprint: bytes, tokens: Sequence[int], n_records: int, *, store_key: bool
) -> bytes:
    if len(fingerprint) != DIGEST_BYTES:
        raise ValueError(f"a fingerprint is {DIGEST_BYTES} bytes, got {len(fingerprint)}")
    toks = [int(t) for t in tokens]
    parts = [
        struct.pack("<III", MAGIC, layout.version, kind),
        layout.pack(),
        fingerprint,
        struct.pack("<I", len(toks)),
        token_digest(toks),
        struct.pack(f"<{len(toks)}I", *toks) if store_key else b"",
        struct.pack("<I", n_records),
    ]
    head = b"".join(parts)
    return head + struct.pack("<I", zlib.crc32(head))


def _record_bytes(layout: Layout, n_tokens: int, ckpt: Checkpoint, n_key: int) -> bytes:
    if not 1 <= n_tokens <= n_key:
        raise ValueError(f"a record folds 1 to {n_key} tokens, got {n_tokens}")
    rows = [e for e in (*ckpt.r_rows, *ckpt.s_rows) if e is not None and _width(e)]  # LFM2's s rows: none
    widths = layout.arrays()
    if [_width(e) for e in rows] != widths or ckpt.codec not in CODEC_IDS:
        raise ValueError("the checkpoint does not fit this layout")
    if (ckpt.kv is None) != (not layout.kv):
        raise ValueError("the checkpoint's KV rows do not fit this layout (hybrid or not)")
    parts = [struct.pack("<IiI", n_tokens, ckpt.pos, CODEC_IDS[ckpt.codec])]
    for e in rows:
        parts.append(tensor_bytes(e.data))
        if e.scales is not None:
            parts.append(tensor_bytes(e.scales))
    if ckpt.kv is not None:
        parts.append(kv_record_bytes(ckpt.kv, layout.kv))
    body = b"".join(parts)
    return struct.pack("<Q", len(body) + 4) + body + struct.pack("<I", zlib.crc32(body))


def _width(e: Encoded) -> int:
    n = 1
    for d in e.shape:
        n *= d
    return n


# ---------------------------------------------------------------- reading


def read_header(read: Callable[[int], bytes]) -> Header:
    """The header alone, from ``read(n)`` (a file's ``read``): the rows are not read. Checks the magic,
    version, kind and checksum, not the layout or fingerprint (:func:`check_header` does)."""
    buf = bytearray()

    def take(n: int, what: str) -> Reader:
        chunk = read(n)
        if len(chunk) != n:
            raise CheckpointFileError(f"truncated: {what} needs {n} bytes at offset {len(buf)}")
        buf.extend(chunk)
        return Reader(chunk)

    magic, version, kind, state_type, n_layer = take(20, "the header").unpack("IIIII", "the header")
    if magic != MAGIC:
        raise CheckpointFileError(f"magic is {magic:#010x}, expected {MAGIC:#010x} (not a checkpoint file)")
    if version not in (VERSION, VERSION_KV):
        raise CheckpointFileError(
            f"version {version} is not supported (this reads {VERSION} and {VERSION_KV})"
        )
    if kind not in (KIND_COMPANION, KIND_ENTRY) or n_layer > MAX_LAYERS:
        raise CheckpointFileError(f"corrupt header: kind {kind}, {n_layer} layers")
    flat = take(8 * n_layer, "the layer widths").unpack(f"{2 * n_layer}I", "the layer widths")
    kv_type: int = 0
    kv_dims: KVDims = ()
    if version == VERSION_KV:
        try:
            kv_type, kv_dims = read_dims(lambda n, what: take(4 * n, what).unpack(f"{n}I", what))
        except StateFormatError as exc:
            raise CheckpointFileError(str(exc)) from None
        if not kv_dims or kv_type not in DTYPE_OF_GGML_TYPE:
            raise CheckpointFileError(f"corrupt header: KV type {kv_type}, {len(kv_dims)} attention layers")
    fingerprint = bytes(take(DIGEST_BYTES, "the fingerprint").take(DIGEST_BYTES, "the fingerprint"))
    n_key = take(4, "the key length").u32("the key length")
    if n_key > MAX_KEY_TOKENS:
        raise CheckpointFileError(f"corrupt header: a key of {n_key} tokens")
    digest = bytes(take(DIGEST_BYTES, "the key digest").take(DIGEST_BYTES, "the key digest"))
    key: tuple[int, ...] = ()
    if kind == KIND_ENTRY:
        key = tuple(int(t) for t in take(4 * n_key, "the key tokens").unpack(f"{n_key}I", "the key tokens"))
    n_records = take(4, "the record count").u32("the record count")
    crc = take(4, "the header checksum").u32("the header checksum")
    if zlib.crc32(bytes(buf[:-4])) != crc:
        raise CheckpointFileError("the header's checksum does not match (corrupt file)")
    if kind == KIND_ENTRY and (token_digest(key) != digest or n_records != 1):
        raise CheckpointFileError("corrupt entry header: its tokens do not match their digest")
    widths = tuple((int(flat[2 * i]), int(flat[2 * i + 1])) for i in range(n_layer))
    layout = Layout(int(state_type), widths, kv_type, kv_dims)
    return Header(kind, layout, fingerprint, n_key, digest, key, n_records, len(buf))


def check_header(header: Header, *, kind: int, layout: Layout, fingerprint: bytes) -> None:
    """Refuse a file of another kind, from a memory of another shape, or from another model."""
    if header.kind != kind:
        raise CheckpointFileError(f"a file of kind {header.kind}, expected {kind}")
    if header.layout != layout:
        raise CheckpointFileError(
            f"the checkpoints were taken from a memory of another shape ({_describe(header.layout)}; "
            f"this memory: {_describe(layout)})"
        )
    if header.fingerprint != fingerprint:
        raise CheckpointFileError("the checkpoints were taken with another model (fingerprint differs)")


def parse_file(
    data: bytes | bytearray | memoryview,
    *,
    kind: int,
    layout: Layout,
    fingerprint: bytes,
    key_tokens: Sequence[int],
) -> list[tuple[int, Checkpoint]]:
    """Every record of a file, checked (see the module), as (n_tokens, checkpoint) sorted by n_tokens.

    ``key_tokens``: a companion's sequence file tokens, or the tokens an entry is expected to hold."""
    view = memoryview(data)
    pos = 0

    def read(n: int) -> bytes:
        nonlocal pos
        chunk = bytes(view[pos : pos + n])
        pos += len(chunk)
        return chunk

    header = read_header(read)
    check_header(header, kind=kind, layout=layout, fingerprint=fingerprint)
    if header.n_key != len(key_tokens) or header.key_digest != token_digest([int(t) for t in key_tokens]):
        raise CheckpointFileError("the checkpoints belong to other tokens than the sequence's")
    reader = Reader(view[header.size :])
    records = [_parse_record(reader, layout, header.n_key, i) for i in range(header.n_records)]
    try:
        reader.expect_end()
    except StateFormatError as exc:
        raise CheckpointFileError(str(exc)) from None
    counts = [n for n, _ in records]
    if len(set(counts)) != len(counts):
        raise CheckpointFileError("two records fold the same tokens")
    if kind == KIND_ENTRY and counts != [header.n_key]:
        raise CheckpointFileError("an entry's record must fold all its tokens")
    return sorted(records, key=lambda r: r[0])


def _parse_record(reader: Reader, layout: Layout, n_key: int, i: int) -> tuple[int, Checkpoint]:
    try:
        size = int(reader.unpack("Q", f"the size of record {i}")[0])
        raw = reader.take(size, f"record {i}")
    except StateFormatError as exc:
        raise CheckpointFileError(str(exc)) from None
    if size < 16:
        raise CheckpointFileError(f"record {i}: {size} bytes is too short")
    body = raw[:-4]
    if zlib.crc32(body) != struct.unpack_from("<I", raw, size - 4)[0]:
        raise CheckpointFileError(f"record {i}: the checksum does not match (corrupt file)")
    n_tokens, ckpt_pos, codec_id = struct.unpack_from("<IiI", body, 0)
    codec = CODEC_NAMES.get(codec_id)
    if codec is None or not 1 <= n_tokens <= n_key or ckpt_pos < 0:
        raise CheckpointFileError(
            f"record {i}: codec {codec_id}, {n_tokens} tokens of {n_key}, pos {ckpt_pos}"
        )
    widths = layout.arrays()
    sizes = [array_sizes(w, codec, layout.dtype) for w in widths]
    expected = 12 + sum(d + s for d, s in sizes)
    if len(body) != expected and not (layout.kv and len(body) > expected):
        raise CheckpointFileError(
            f"record {i}: {len(body)} bytes, {codec} rows of this memory need {expected}"
        )
    rows: list[Encoded] = []
    offset = 12
    for w, (d_bytes, s_bytes) in zip(widths, sizes, strict=True):
        data, scales = decode_array(
            body[offset : offset + d_bytes + s_bytes], w, d_bytes, codec, layout.dtype
        )
        if not bool(torch.isfinite(data.to(torch.float32) if scales is None else scales).all()):
            raise CheckpointFileError(f"record {i}: rows hold NaN or inf")
        rows.append(Encoded(data, scales, (1, w), layout.dtype))
        offset += d_bytes + s_bytes
    n_r = sum(1 for w, _ in layout.widths if w)
    r_it, s_it = iter(rows[:n_r]), iter(rows[n_r:])
    empty = Encoded(torch.empty(1, 0, dtype=layout.dtype), None, (1, 0), layout.dtype)

    def row(w: int, kept: bool, it: Iterator[Encoded]) -> Encoded | None:
        return next(it) if w else empty if kept else None  # a kept layer's zero-width rows stay

    r_rows = tuple(row(r, bool(r or s), r_it) for r, s in layout.widths)
    s_rows = tuple(row(s, bool(r or s), s_it) for r, s in layout.widths)
    kv = None
    if layout.kv:
        try:
            kv = parse_kv(body, expected, layout.kv, codec, layout.kv_dtype, int(ckpt_pos), f"record {i}")
        except StateFormatError as exc:
            raise CheckpointFileError(str(exc)) from None
    return int(n_tokens), Checkpoint(int(ckpt_pos), codec, r_rows, s_rows, kv)


def _describe(layout: Layout) -> str:
    state = GGML_TYPE_NAMES.get(layout.state_type, f"type {layout.state_type}")
    widths = layout.arrays()
    return f"{len(layout.widths)} layers, {len(widths)} rows of widths {sorted(set(widths))}, {state}"
