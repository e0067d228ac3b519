"""Saving and restoring recurrent state, byte-compatible with llama.cpp.

Layout of the recurrent payload (llama.cpp's ``state_write``), little-endian::

    u32 cell_count
    per cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id   (n_seq_id = 0 when one sequence is saved)
    u32 s_trans (0), u32 n_layer (filtered layers included)
    per layer with r: i32 ggml_type, u64 row_bytes, cell_count rows;  then the same for every s layer

Around it: the in-memory sequence blob (magic 0xaf143cd8, source seq id), sequence files ('ggsq',
version 3, tokens) and session files ('ggsn', version 9, tokens, arch name). The framing takes any
:class:`~rsmem.memory.protocol.SequenceMemory`: what lies inside it is the memory's ``state_write`` (a hybrid
memory's KV part comes first), read back by its ``state_read``.

Reading is two-phase: :func:`parse_payload` checks every field against the memory and decodes the rows
without touching anything (rows must be finite: a NaN or inf state would poison every token decoded
after it); only then :func:`restore_payload` changes the memory. A failure in either phase leaves the
memory exactly as it was (llama.cpp clears the destination instead).
"""

from __future__ import annotations

import os
import struct
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rsmem.batch.allocator import BatchAllocator
from rsmem.errors import NoSlotError, StateFormatError

if TYPE_CHECKING:  # the memory imports its rollback, which installs states through this module
    from rsmem.memory.protocol import SequenceMemory
    from rsmem.memory.recurrent import RecurrentMemory

GGML_TYPE_OF_DTYPE = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 30}
DTYPE_OF_GGML_TYPE = {v: k for k, v in GGML_TYPE_OF_DTYPE.items()}
GGML_TYPE_NAMES = {0: "F32", 1: "F16", 8: "Q8_0", 30: "BF16"}

SEQ_BLOB_MAGIC = 0xAF143CD8
SEQ_FILE_MAGIC = 0x67677371  # 'ggsq'
SEQ_FILE_VERSION = 3  # what llama.cpp 0.3.36 writes; version 2 has the same layout
SEQ_FILE_VERSIONS_READ = (2, 3)
SESSION_MAGIC = 0x6767736E  # 'ggsn'
SESSION_VERSION = 9


class Reader:
    """Bounds-checked little-endian reads; every shortfall names the field that was cut off."""

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        self.data = memoryview(data)
        self.offset = 0

    def unpack(self, fmt: str, what: str) -> tuple[Any, ...]:
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.data):
            raise StateFormatError(
                f"truncated: {what} needs {size} bytes at offset {self.offset}, "
                f"only {len(self.data) - self.offset} left"
            )
        values = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += size
        return values

    def u32(self, what: str) -> int:
        return int(self.unpack("I", what)[0])

    def i32(self, what: str) -> int:
        return int(self.unpack("i", what)[0])

    def take(self, n: int, what: str) -> memoryview:
        if n < 0 or self.offset + n > len(self.data):
            raise StateFormatError(
                f"truncated: {what} needs {n} bytes at offset {self.offset}, "
                f"only {len(self.data) - self.offset} left"
            )
        chunk = self.data[self.offset : self.offset + n]
        self.offset += n
        return chunk

    def expect_end(self) -> None:
        extra = len(self.data) - self.offset
        if extra:
            raise StateFormatError(f"{extra} unexpected bytes after the state at offset {self.offset}")


@dataclass(slots=True)
class Payload:
    """A decoded, validated payload: cell metadata and per-layer rows in the memory's dtype."""

    cells: list[tuple[int, tuple[int, ...]]]  # (pos, seq ids) per cell
    r_rows: list[torch.Tensor | None]
    s_rows: list[torch.Tensor | None]


# ---------------------------------------------------------------- writing


def _rows_bytes(t: torch.Tensor, index: list[int]) -> bytes:
    rows = t.index_select(0, torch.tensor(index, dtype=torch.long, device=t.device)).contiguous().cpu()
    return rows.view(torch.uint8).numpy().tobytes()


def write_payload(memory: RecurrentMemory, seq_id: int = -1) -> bytes:
    """The payload of one sequence (``seq_id >= 0``) or of every non-empty cell (``-1``)."""
    cells = memory.cells
    if seq_id >= 0:
        memory.require_seq(seq_id, "state write")
        index = [cells.tail[seq_id]] if cells.tail[seq_id] >= 0 else []
    else:
        index = [c for c in range(memory.size) if cells.seqs[c]]
    out = [struct.pack("<I", len(index))]
    for c in index:
        ids = sorted(cells.seqs[c]) if seq_id < 0 else []
        out.append(struct.pack(f"<iI{len(ids)}i", cells.pos[c], len(ids), *ids))
    out.append(struct.pack("<II", 0, memory.n_layer))
    for tensors in (memory.r_l, memory.s_l):
        for t in tensors:
            if t is None:
                continue
            out.append(struct.pack("<iQ", GGML_TYPE_OF_DTYPE[t.dtype], t.shape[1] * t.element_size()))
            if index:
                out.append(_rows_bytes(t, index))
    return b"".join(out)


# ---------------------------------------------------------------- reading


def _parse_rows(
    reader: Reader, t: torch.Tensor, cell_count: int, kind: str, il: int, owners: list[str]
) -> torch.Tensor:
    """Layer ``il``'s ``kind`` rows of ``cell_count`` cells, in ``t``'s dtype, checked to be finite;
    ``owners[c]`` names cell ``c``'s sequences in an error message ("for sequence 3")."""
    type_id = reader.i32(f"{kind} type of layer {il}")
    row_bytes = reader.unpack("Q", f"{kind} row size of layer {il}")[0]
    dtype = DTYPE_OF_GGML_TYPE.get(type_id)
    if dtype is None:
        name = GGML_TYPE_NAMES.get(type_id, f"unknown type {type_id}")
        raise StateFormatError(f"layer {il}: {kind} rows are {name}; only F32, F16 and BF16 states load")
    n_embd = t.shape[1]
    expected = n_embd * torch.finfo(dtype).bits // 8
    if row_bytes != expected:
        raise StateFormatError(
            f"layer {il}: {kind} row size is {row_bytes} bytes, this model needs {expected} "
            f"({n_embd} x {GGML_TYPE_NAMES[type_id]})"
        )
    raw = reader.take(cell_count * row_bytes, f"{kind} rows of layer {il}")
    if cell_count * n_embd == 0:  # no cells, or 0-value rows (LFM2's s): frombuffer refuses empty buffers
        return torch.empty(cell_count, n_embd, dtype=t.dtype)
    stored = torch.frombuffer(bytearray(raw), dtype=dtype).view(cell_count, n_embd)
    rows = stored.to(t.dtype)
    _require_finite(rows, stored, kind, il, owners)
    return rows


def _require_finite(rows: torch.Tensor, stored: torch.Tensor, kind: str, il: int, owners: list[str]) -> None:
    """Raise StateFormatError naming the layer, the tensor and the sequence when ``rows`` (``stored``
    converted to the memory's dtype) hold a NaN or an inf: such a state would poison every token decoded
    after it. One ``isfinite`` pass over the block when it is finite."""
    if bool(torch.isfinite(rows).all()):
        return
    bad = ~torch.isfinite(rows)
    c = int(bad.any(dim=1).nonzero()[0, 0])  # the first offending cell
    found = " and ".join(
        name for name, test in (("NaN", torch.isnan), ("inf", torch.isinf)) if test(rows[c]).any()
    )
    if bool(torch.isfinite(stored[c]).all()):
        found += f" (finite {stored.dtype} values out of range of the {rows.dtype} memory)"
    raise StateFormatError(
        f"layer {il}: the {kind} state {owners[c]} holds {int(bad[c].sum())} non-finite values: {found}"
    )


def parse_payload(reader: Reader, memory: RecurrentMemory, dest_seq: int) -> Payload:
    """Decode and validate a payload against ``memory``: one sequence's state to restore into ``dest_seq``,
    or (``dest_seq < 0``) the whole memory's. Raises StateFormatError; changes nothing."""
    single_seq = dest_seq >= 0
    cell_count = reader.u32("cell count")
    if single_seq and cell_count > 1:
        raise StateFormatError(f"a sequence's state has at most one cell, this one has {cell_count}")
    if cell_count > memory.size:
        raise StateFormatError(f"state has {cell_count} cells, the memory only {memory.size}")
    cells: list[tuple[int, tuple[int, ...]]] = []
    seen: dict[int, int] = {}
    for i in range(cell_count):
        pos, n_seq_id = reader.unpack("iI", f"cell {i} header")
        if pos < 0:
            raise StateFormatError(f"cell {i}: position {pos} is negative")
        if single_seq and n_seq_id != 0:
            raise StateFormatError(f"cell {i}: a sequence's state lists {n_seq_id} seq ids, expected 0")
        if not single_seq and not 1 <= n_seq_id <= memory.size:
            raise StateFormatError(f"cell {i}: {n_seq_id} seq ids, expected 1 to {memory.size}")
        ids = reader.unpack(f"{n_seq_id}i", f"cell {i} seq ids") if n_seq_id else ()
        for s in ids:
            if not 0 <= s < memory.size:
                raise StateFormatError(f"cell {i}: seq id {s} is outside [0, {memory.size})")
            if s in seen:
                raise StateFormatError(f"cell {i}: seq id {s} already has a tail in cell {seen[s]}")
            seen[s] = i
        cells.append((pos, tuple(ids)))
    s_trans = reader.u32("s_trans flag")
    if s_trans != 0:
        raise StateFormatError(f"s_trans is {s_trans}; only untransposed states (0) exist for this memory")
    n_layer = reader.u32("layer count")
    if n_layer != memory.n_layer:
        raise StateFormatError(f"state has {n_layer} layers, the model {memory.n_layer}")
    if single_seq:
        owners = [f"for sequence {dest_seq}"] * cell_count
    else:
        owners = [
            f"of cell {c} (sequence{'s' * (len(ids) > 1)} {', '.join(map(str, ids))})"
            for c, (_, ids) in enumerate(cells)
        ]
    r_rows = [
        None if t is None else _parse_rows(reader, t, cell_count, "r", il, owners)
        for il, t in enumerate(memory.r_l)
    ]
    s_rows = [
        None if t is None else _parse_rows(reader, t, cell_count, "s", il, owners)
        for il, t in enumerate(memory.s_l)
    ]
    return Payload(cells, r_rows, s_rows)


def _write_rows(memory: RecurrentMemory, payload: Payload, first_cell: int) -> None:
    n = len(payload.cells)
    for dst, rows in ((memory.r_l, payload.r_rows), (memory.s_l, payload.s_rows)):
        for t, src in zip(dst, rows):
            if t is not None and src is not None:
                t[first_cell : first_cell + n] = src.to(t.device)


def read_state(memory: RecurrentMemory, reader: Reader, dest_seq: int = -1) -> None:
    """``RecurrentMemory.state_read``: :func:`parse_payload`, which must end ``reader``'s data, then
    :func:`restore_payload`."""
    payload = parse_payload(reader, memory, dest_seq)
    reader.expect_end()
    restore_payload(memory, payload, dest_seq)


def restore_payload(memory: RecurrentMemory, payload: Payload, dest_seq: int) -> None:
    """Install a parsed payload as ``dest_seq``'s state, or as the whole memory when ``dest_seq < 0``."""
    if dest_seq < 0:
        memory.clear(data=True)
        cells = memory.cells
        for c, (pos, ids) in enumerate(payload.cells):
            cells.pos[c], cells.src[c], cells.seqs[c] = pos, c, set(ids)
            for s in ids:
                cells.tail[s] = c
        memory.used = len(payload.cells)
        _write_rows(memory, payload, 0)
        return
    memory.require_seq(dest_seq, "state restore")
    if not payload.cells:
        memory.seq_rm(dest_seq, -1, -1)
        return
    install_state(memory, dest_seq, payload.cells[0][0], lambda cell: _write_rows(memory, payload, cell))


def can_install(memory: RecurrentMemory, seq_id: int) -> bool:
    """Whether :func:`install_state` would find a cell for ``seq_id`` (a dry run; nothing changes)."""
    return _place_alone(memory, seq_id, 0, commit=False)


def install_state(memory: RecurrentMemory, seq_id: int, pos: int, write_rows: Callable[[int], None]) -> None:
    """Make ``seq_id``'s state a cell of its own at ``pos`` whose rows ``write_rows(cell)`` fills; the old
    cell is released as ``seq_rm`` does (and the rollback history with it). Raises NoSlotError, with the
    memory and its history unchanged, when no cell is free (the sequence shared its cell)."""
    memory.require_seq(seq_id, "state restore")
    if not _place_alone(memory, seq_id, pos, commit=True):
        raise NoSlotError(f"no free cell to restore sequence {seq_id}")
    write_rows(memory.head)


def _place_alone(memory: RecurrentMemory, seq_id: int, pos: int, *, commit: bool) -> bool:
    """Release ``seq_id``'s cell and place it in a free one at ``pos``; unless that worked and ``commit``,
    put the metadata and the sequence's rollback history back as they were."""
    saved = (memory.cells.copy(), memory.head, memory.used, memory.n, memory.rs_z)
    history = memory.rollback.get(seq_id) if memory.rollback is not None else None
    placed = False
    try:
        memory.seq_rm(seq_id, -1, -1)
        placed = memory.find_slot(BatchAllocator.ubatch_reserve(1, 1, seq_id=seq_id, pos=[pos]))
        return placed
    finally:
        if not (placed and commit):
            memory.cells, memory.head, memory.used, memory.n, memory.rs_z = saved
            if memory.rollback is not None:
                memory.rollback.put(seq_id, history)


# ---------------------------------------------------------------- framing


def seq_blob(memory: SequenceMemory, seq_id: int) -> bytes:
    """``llama_state_seq_get_data``: magic, source seq id, the sequence's state."""
    return struct.pack("<Ii", SEQ_BLOB_MAGIC, seq_id) + memory.state_write(seq_id)


def load_seq_blob(memory: SequenceMemory, data: bytes, dest_seq: int) -> int:
    """``llama_state_seq_set_data``: restore a blob into ``dest_seq``; returns the bytes read."""
    memory.require_seq(dest_seq, "state restore")
    reader = Reader(data)
    magic = reader.u32("blob magic")
    if magic != SEQ_BLOB_MAGIC:
        raise StateFormatError(f"blob magic is {magic:#010x}, expected {SEQ_BLOB_MAGIC:#010x}")
    source = reader.i32("source seq id")
    if source < 0:
        raise StateFormatError(f"source seq id {source} is negative")
    memory.state_read(reader, dest_seq)
    return reader.offset


def _tokens_header(magic: int, version: int, tokens: list[int]) -> bytes:
    return struct.pack(f"<III{len(tokens)}i", magic, version, len(tokens), *tokens)


def _read_tokens_header(
    reader: Reader, magic: int, versions: tuple[int, ...], kind: str, n_vocab: int | None
) -> list[int]:
    got = reader.u32(f"{kind} magic")
    if got != magic:
        raise StateFormatError(f"not a {kind}: magic is {got:#010x}, expected {magic:#010x}")
    version = reader.u32(f"{kind} version")
    if version not in versions:
        raise StateFormatError(f"{kind} version {version} is not supported (reads {list(versions)})")
    n_tokens = reader.u32("token count")
    if n_tokens * 4 > len(reader.data) - reader.offset:
        raise StateFormatError(f"truncated: {n_tokens} tokens do not fit in the {kind}")
    tokens = list(reader.unpack(f"{n_tokens}i", "tokens"))
    if n_vocab is not None:
        for i, t in enumerate(tokens):
            if not 0 <= t < n_vocab:
                raise StateFormatError(f"{kind} token {i}: id {t} is outside the vocabulary [0, {n_vocab})")
    return tokens


def seq_file_bytes(memory: SequenceMemory, seq_id: int, tokens: list[int]) -> bytes:
    """``llama_state_seq_save_file``'s bytes: 'ggsq', version, tokens, the sequence's state."""
    return _tokens_header(SEQ_FILE_MAGIC, SEQ_FILE_VERSION, tokens) + memory.state_write(seq_id)


def load_seq_file_bytes(
    memory: SequenceMemory, data: bytes, dest_seq: int, n_vocab: int | None = None
) -> list[int]:
    """Restore a sequence file's state into ``dest_seq``; returns its tokens (each checked against
    ``n_vocab`` when given, before anything is applied)."""
    memory.require_seq(dest_seq, "state restore")
    reader = Reader(data)
    tokens = _read_tokens_header(
        reader, SEQ_FILE_MAGIC, SEQ_FILE_VERSIONS_READ, "sequence state file", n_vocab
    )
    memory.state_read(reader, dest_seq)
    return tokens


def context_state_bytes(memory: SequenceMemory, arch: str) -> bytes:
    """Whole-context state data: arch name (u32 length + bytes), then every sequence's state."""
    name = arch.encode()
    return struct.pack("<I", len(name)) + name + memory.state_write(-1)


def load_context_state(memory: SequenceMemory, reader: Reader, arch: str) -> None:
    """Restore whole-context state data written by :func:`context_state_bytes`."""
    n = reader.u32("arch name length")
    name = bytes(reader.take(n, "arch name")).decode(errors="replace")
    if name != arch:
        raise StateFormatError(f"state was saved by a {name!r} model, this one is {arch!r}")
    memory.state_read(reader, -1)


def session_file_bytes(memory: SequenceMemory, arch: str, tokens: list[int]) -> bytes:
    """``llama_state_save_file``'s bytes: 'ggsn', version 9, tokens, context state."""
    return _tokens_header(SESSION_MAGIC, SESSION_VERSION, tokens) + context_state_bytes(memory, arch)


def load_session_file_bytes(
    memory: SequenceMemory, data: bytes, arch: str, n_vocab: int | None = None
) -> list[int]:
    reader = Reader(data)
    tokens = _read_tokens_header(reader, SESSION_MAGIC, (SESSION_VERSION,), "session file", n_vocab)
    load_context_state(memory, reader, arch)
    return tokens


def atomic_write(path: str | os.PathLike[str], data: bytes) -> int:
    """Write ``data`` to ``path`` through a temporary file, fsync and rename: never a torn file."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return len(data)
