"""Checkpoint files: the checkpoints of a saved sequence, and prefix-cache entries kept on disk.

A llama.cpp sequence file (``.ggsq``, :mod:`rsmem.memory.state_io`) holds one state: the sequence's
newest. The checkpoints of that sequence (its state after shorter prefixes of the same tokens, see
:mod:`rsmem.memory.checkpoint`) go in a **companion** file next to it, ``<name>.ckpt``, so the ``.ggsq``
stays byte for byte what llama.cpp writes and reads. A prefix cache kept on disk (``--cache-dir``) stores
each checkpoint in an **entry** file of the same format, with its key tokens in the header.

Layout, little-endian::

    header
      u32 magic 0x6b637372 ('rsck')    u32 version (1)     u32 kind (1: companion, 2: entry)
      u32 state type (ggml: 0 F32, 1 F16, 30 BF16)         u32 n_layer
      n_layer x (u32 r_width, u32 s_width)                 values per row; 0: the layer keeps no rows
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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from rsmem.errors import StateFormatError
from rsmem.memory.checkpoint import INT8_BLOCK, Checkpoint, Encoded
from rsmem.memory.recurrent import RecurrentMemory
from rsmem.memory.state_io import DTYPE_OF_GGML_TYPE, GGML_TYPE_NAMES, GGML_TYPE_OF_DTYPE, Reader

MAGIC = 0x6B637372  # b"rsck" as a little-endian u32
VERSION = 1
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
    """The shape of one sequence's state: the state type and each layer's (r, s) row widths."""

    state_type: int
    widths: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, memory: RecurrentMemory) -> Layout:
        def width(t: torch.Tensor | None) -> int:
            return 0 if t is None else int(t.shape[1])

        return cls(
            GGML_TYPE_OF_DTYPE[memory.dtype],
            tuple((width(r), width(s)) for r, s in zip(memory.r_l, memory.s_l, strict=True)),
        )

    @property
    def dtype(self) -> torch.dtype:
        return DTYPE_OF_GGML_TYPE[self.state_type]

    def arrays(self) -> list[int]:
        """The widths of the rows a record holds, in order (r rows of every layer, then s rows)."""
        return [w for w, _ in self.widths if w] + [w for _, w in self.widths if w]

    def pack(self) -> bytes:
        flat = [v for pair in self.widths for v in pair]
        return struct.pack(f"<II{len(flat)}I", self.state_type, len(self.widths), *flat)


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


def entry_size(layout: Layout, n_tokens: int, codec: str) -> int:
    """The bytes :func:`entry_bytes` writes for a key of ``n_tokens`` tokens in ``codec``."""
    header = 20 + 8 * len(layout.widths) + DIGEST_BYTES + 4 + DIGEST_BYTES + 4 * n_tokens + 8
    rows = sum(d + s for d, s in (_array_sizes(w, codec, layout.dtype) for w in layout.arrays()))
    return header + 8 + 12 + rows + 4


def _header_bytes(
    kind: int, layout: Layout, fingerprint: bytes, tokens: Sequence[int], n_records: int, *, store_key: bool
) -> bytes:
    if len(fingerprint) != DIGEST_BYTES:
        raise ValueError(f"a fingerprint is {DIGEST_BYTES} bytes, got {len(fingerprint)}")
    toks = [int(t) for t in tokens]
    parts = [
        struct.pack("<III", MAGIC, VERSION, kind),
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
    rows = [e for e in (*ckpt.r_rows, *ckpt.s_rows) if e is not None]
    widths = layout.arrays()
    if [_width(e) for e in rows] != widths or ckpt.codec not in CODEC_IDS:
        raise ValueError("the checkpoint does not fit this layout")
    parts = [struct.pack("<IiI", n_tokens, ckpt.pos, CODEC_IDS[ckpt.codec])]
    for e in rows:
        parts.append(_tensor_bytes(e.data))
        if e.scales is not None:
            parts.append(_tensor_bytes(e.scales))
    body = b"".join(parts)
    return struct.pack("<Q", len(body) + 4) + body + struct.pack("<I", zlib.crc32(body))


def _width(e: Encoded) -> int:
    n = 1
    for d in e.shape:
        n *= d
    return n


def _tensor_bytes(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())


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
    if version != VERSION:
        raise CheckpointFileError(f"version {version} is not supported (this reads version {VERSION})")
    if kind not in (KIND_COMPANION, KIND_ENTRY) or n_layer > MAX_LAYERS:
        raise CheckpointFileError(f"corrupt header: kind {kind}, {n_layer} layers")
    flat = take(8 * n_layer, "the layer widths").unpack(f"{2 * n_layer}I", "the layer widths")
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
    layout = Layout(int(state_type), widths)
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
    sizes = [_array_sizes(w, codec, layout.dtype) for w in widths]
    expected = 12 + sum(d + s for d, s in sizes)
    if len(body) != expected:
        raise CheckpointFileError(
            f"record {i}: {len(body)} bytes, {codec} rows of this memory need {expected}"
        )
    rows: list[Encoded] = []
    offset = 12
    for w, (d_bytes, s_bytes) in zip(widths, sizes, strict=True):
        data, scales = _decode_array(
            body[offset : offset + d_bytes + s_bytes], w, d_bytes, codec, layout.dtype
        )
        if not bool(torch.isfinite(data.to(torch.float32) if scales is None else scales).all()):
            raise CheckpointFileError(f"record {i}: rows hold NaN or inf")
        rows.append(Encoded(data, scales, (1, w), layout.dtype))
        offset += d_bytes + s_bytes
    n_r = sum(1 for w, _ in layout.widths if w)
    r_it, s_it = iter(rows[:n_r]), iter(rows[n_r:])
    r_rows = tuple(next(r_it) if w else None for w, _ in layout.widths)
    s_rows = tuple(next(s_it) if w else None for _, w in layout.widths)
    return int(n_tokens), Checkpoint(int(ckpt_pos), codec, r_rows, s_rows)


def _array_sizes(width: int, codec: str, dtype: torch.dtype) -> tuple[int, int]:
    """Bytes of one row's data and scales in ``codec``."""
    if codec == "exact":
        return width * torch.finfo(dtype).bits // 8, 0
    if codec == "bf16":
        return width * 2, 0
    blocks = -(-width // INT8_BLOCK)
    return blocks * INT8_BLOCK, blocks * 4


def _decode_array(
    raw: memoryview, width: int, d_bytes: int, codec: str, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor | None]:
    buf = bytearray(raw)
    if codec == "int8":
        data = torch.frombuffer(buf[:d_bytes], dtype=torch.int8).view(-1, INT8_BLOCK)
        return data, torch.frombuffer(buf[d_bytes:], dtype=torch.float32)
    stored = dtype if codec == "exact" else torch.bfloat16
    return torch.frombuffer(buf, dtype=stored).view(1, width), None


def _describe(layout: Layout) -> str:
    state = GGML_TYPE_NAMES.get(layout.state_type, f"type {layout.state_type}")
    widths = layout.arrays()
    return f"{len(layout.widths)} layers, {len(widths)} rows of widths {sorted(set(widths))}, {state}"
