"""Hybrid state bytes around :meth:`HybridMemory.state_write` / ``state_read``: the sequence blob, the
'ggsq' sequence file and the 'ggsn' session file, framed as :mod:`rsmem.memory.state_io` frames the
recurrent memory's (llama.cpp's ``llama_state_seq_get_data`` / ``llama_state_seq_save_file`` / ...), and the
recurrent part's parser for states with 0-byte rows.

Each loader reads the whole input and checks it (``expect_end`` included) before anything is installed.
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import torch

from rsmem.errors import StateFormatError
from rsmem.memory import state_io
from rsmem.memory.state_io import DTYPE_OF_GGML_TYPE, Payload, Reader

if TYPE_CHECKING:
    from rsmem.memory.hybrid import HybridMemory
    from rsmem.memory.recurrent import RecurrentMemory


def seq_blob(memory: HybridMemory, seq_id: int) -> bytes:
    """``llama_state_seq_get_data``: magic, source seq id, KV part, recurrent part."""
    return struct.pack("<Ii", state_io.SEQ_BLOB_MAGIC, seq_id) + memory.state_write(seq_id)


def load_seq_blob(memory: HybridMemory, data: bytes, dest_seq: int) -> int:
    """``llama_state_seq_set_data``: restore a blob into ``dest_seq``; returns the bytes read."""
    memory.require_seq(dest_seq, "state restore")
    reader = Reader(data)
    magic = reader.u32("blob magic")
    if magic != state_io.SEQ_BLOB_MAGIC:
        raise StateFormatError(f"blob magic is {magic:#010x}, expected {state_io.SEQ_BLOB_MAGIC:#010x}")
    if reader.i32("source seq id") < 0:
        raise StateFormatError("source seq id is negative")
    state = memory.parse_state(reader, dest_seq)
    reader.expect_end()
    memory.install_state(state, dest_seq)
    return reader.offset


def _tokens(
    reader: Reader, magic: int, versions: tuple[int, ...], kind: str, n_vocab: int | None
) -> list[int]:
    if reader.u32(f"{kind} magic") != magic:
        raise StateFormatError(f"not a {kind}: bad magic")
    version = reader.u32(f"{kind} version")
    if version not in versions:
        raise StateFormatError(f"{kind} version {version} is not supported (reads {list(versions)})")
    n = reader.u32("token count")
    if n * 4 > len(reader.data) - reader.offset:
        raise StateFormatError(f"truncated: {n} tokens do not fit in the {kind}")
    tokens = [int(t) for t in reader.unpack(f"{n}i", "tokens")]
    for i, t in enumerate(tokens):
        if n_vocab is not None and not 0 <= t < n_vocab:
            raise StateFormatError(f"{kind} token {i}: id {t} is outside the vocabulary [0, {n_vocab})")
    return tokens


def seq_file_bytes(memory: HybridMemory, seq_id: int, tokens: list[int]) -> bytes:
    """``llama_state_seq_save_file``'s bytes: 'ggsq', version 3, tokens, then the state."""
    head = struct.pack(
        f"<III{len(tokens)}i", state_io.SEQ_FILE_MAGIC, state_io.SEQ_FILE_VERSION, len(tokens), *tokens
    )
    return head + memory.state_write(seq_id)


def load_seq_file_bytes(
    memory: HybridMemory, data: bytes, dest_seq: int, n_vocab: int | None = None
) -> list[int]:
    """Restore a sequence file into ``dest_seq``; returns its tokens."""
    memory.require_seq(dest_seq, "state restore")
    reader = Reader(data)
    tokens = _tokens(
        reader, state_io.SEQ_FILE_MAGIC, state_io.SEQ_FILE_VERSIONS_READ, "sequence state file", n_vocab
    )
    state = memory.parse_state(reader, dest_seq)
    reader.expect_end()
    memory.install_state(state, dest_seq)
    return tokens


def context_state_bytes(memory: HybridMemory, arch: str) -> bytes:
    """Whole-context state data (``llama_state_get_data``): arch name, then every sequence's state."""
    name = arch.encode()
    return struct.pack("<I", len(name)) + name + memory.state_write(-1)


def load_context_state(memory: HybridMemory, reader: Reader, arch: str) -> None:
    """Restore whole-context state data written by :func:`context_state_bytes` (checked to its end first)."""
    n = reader.u32("arch name length")
    name = bytes(reader.take(n, "arch name")).decode(errors="replace")
    if name != arch:
        raise StateFormatError(f"state was saved by a {name!r} model, this one is {arch!r}")
    state = memory.parse_state(reader, -1)
    reader.expect_end()
    memory.install_state(state, -1)


def session_file_bytes(memory: HybridMemory, arch: str, tokens: list[int]) -> bytes:
    """'ggsn', version 9, tokens, arch name, then every sequence's state (as ``state_io`` lays it out)."""
    head = struct.pack(
        f"<III{len(tokens)}i", state_io.SESSION_MAGIC, state_io.SESSION_VERSION, len(tokens), *tokens
    )
    return head + context_state_bytes(memory, arch)


def load_session_file_bytes(
    memory: HybridMemory, data: bytes, arch: str, n_vocab: int | None = None
) -> list[int]:
    reader = Reader(data)
    tokens = _tokens(reader, state_io.SESSION_MAGIC, (state_io.SESSION_VERSION,), "session file", n_vocab)
    load_context_state(memory, reader, arch)
    return tokens


def parse_recurrent(reader: Reader, memory: RecurrentMemory, dest_seq: int) -> Payload:
    """:func:`~rsmem.memory.state_io.parse_payload` for memories whose ``s`` (or ``r``) rows may be 0 values
    wide (LFM2 has no SSM state: llama.cpp writes 0-byte rows), which ``state_io`` cannot decode."""
    widths = [t.shape[1] for t in (*memory.r_l, *memory.s_l) if t is not None]
    if all(widths):
        return state_io.parse_payload(reader, memory, dest_seq)
    cell_count = reader.u32("cell count")
    if cell_count > (1 if dest_seq >= 0 else memory.size):
        raise StateFormatError(f"recurrent state has {cell_count} cells, at most {memory.size} fit")
    cells = []
    for i in range(cell_count):
        pos, n_ids = reader.unpack("iI", f"cell {i} header")
        if pos < 0 or (dest_seq >= 0 and n_ids != 0) or n_ids > memory.size:
            raise StateFormatError(f"cell {i}: position {pos} with {n_ids} seq ids does not fit this memory")
        ids = reader.unpack(f"{n_ids}i", f"cell {i} seq ids") if n_ids else ()
        if any(not 0 <= s < memory.size for s in ids) or len(set(ids)) != len(ids):
            raise StateFormatError(f"cell {i}: seq ids {list(ids)} do not fit [0, {memory.size})")
        cells.append((pos, tuple(ids)))
    seen = [s for _, ids in cells for s in ids]
    if len(seen) != len(set(seen)) or (dest_seq < 0 and any(not ids for _, ids in cells)):
        raise StateFormatError("a sequence has more than one cell, or a cell has no sequence")
    s_trans, n_layer = reader.unpack("II", "recurrent layout header")
    if s_trans != 0 or n_layer != memory.n_layer:
        raise StateFormatError(
            f"recurrent state: s_trans {s_trans}, {n_layer} layers (model: 0, {memory.n_layer})"
        )
    rows: list[list[torch.Tensor | None]] = []
    for kind, tensors in (("r", memory.r_l), ("s", memory.s_l)):
        rows.append([])
        for il, t in enumerate(tensors):
            if t is None:
                rows[-1].append(None)
                continue
            type_id, row_bytes = reader.unpack("iQ", f"{kind} header of layer {il}")
            dtype = DTYPE_OF_GGML_TYPE.get(type_id)
            width = t.shape[1]
            if dtype is None or row_bytes != width * torch.finfo(dtype).bits // 8:
                raise StateFormatError(
                    f"layer {il}: {kind} rows of type {type_id}, {row_bytes} bytes do not fit"
                )
            raw = reader.take(cell_count * row_bytes, f"{kind} rows of layer {il}")
            if cell_count * width == 0:
                rows[-1].append(torch.empty(cell_count, width, dtype=t.dtype))
                continue
            got = torch.frombuffer(bytearray(raw), dtype=dtype).view(cell_count, width).to(t.dtype)
            if not bool(torch.isfinite(got).all()):
                raise StateFormatError(f"layer {il}: the {kind} state holds non-finite values (NaN or inf)")
            rows[-1].append(got)
    return Payload(cells, rows[0], rows[1])
