"""The hybrid memory's recurrent part, read from state bytes: :func:`parse_recurrent`, for states whose
rows may be 0 bytes wide. The blob, the 'ggsq' sequence file and the 'ggsn' session file around
:meth:`HybridMemory.state_write` / ``state_read`` are :mod:`rsmem.memory.state_io`'s framing, the same for
every memory.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from rsmem.errors import StateFormatError
from rsmem.memory import state_io
from rsmem.memory.state_io import DTYPE_OF_GGML_TYPE, Payload, Reader

if TYPE_CHECKING:
    from rsmem.memory.recurrent import RecurrentMemory


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
