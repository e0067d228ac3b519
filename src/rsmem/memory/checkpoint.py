"""Checkpoints: a copy of one sequence's state at a position, kept outside the memory's cells.

``take(memory, seq)`` copies the rows of ``seq``'s cell, layer by layer (one row copy per layer), with
the cell's position; ``restore(memory, checkpoint, seq)`` installs them as ``seq``'s state through the
same path a state file takes (``state_io.restore_payload``: the destination's old cell is released, a
free cell found, the rows written), so a restored sequence continues exactly as the original did.

Codecs (``Checkpoint.codec``), to fit more checkpoints in a byte budget:

- ``"exact"``: the memory's own dtype; restoring is bit-exact.
- ``"bf16"``: half the bytes of f32 (8 significant bits).
- ``"int8"``: a quarter of the bytes of f32 plus one f32 scale per block of ``INT8_BLOCK`` values
  (symmetric, as GGUF's Q8_0): ~0.28 of f32.

The logit error a lossy codec causes after N further tokens is measured by
``bench/checkpoint_codecs.py`` and documented in the README.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rsmem.memory.recurrent import RecurrentMemory
from rsmem.memory.state_io import Payload, restore_payload

CODECS = ("exact", "bf16", "int8")
INT8_BLOCK = 32


@dataclass(frozen=True, slots=True)
class Encoded:
    """One layer's rows in a codec: ``data`` (and ``scales`` for int8); ``shape`` and ``dtype`` of the
    decoded rows."""

    data: torch.Tensor
    scales: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        extra = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.data.numel() * self.data.element_size() + extra


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """``seq``'s state after position ``pos`` (the last token folded in), in ``codec``."""

    pos: int
    codec: str
    r_rows: tuple[Encoded | None, ...]
    s_rows: tuple[Encoded | None, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in (*self.r_rows, *self.s_rows) if e is not None)

    def is_finite(self) -> bool:
        """No NaN or inf in any row (int8 rows are finite when their scales are)."""
        return all(
            bool(torch.isfinite(e.data if e.scales is None else e.scales).all())
            for e in (*self.r_rows, *self.s_rows)
            if e is not None
        )


def check_codec(codec: str) -> None:
    """Raise ValueError unless ``codec`` is one of :data:`CODECS`."""
    if codec not in CODECS:
        raise ValueError(f"unknown checkpoint codec {codec!r}: use one of {', '.join(CODECS)}")


def encode(rows: torch.Tensor, codec: str) -> Encoded:
    """One layer's state rows (``[1, n_embd]`` in the memory's dtype) in ``codec``, as :func:`take` keeps
    them: for builders of checkpoints from rows that are not a cell's (``rsmem.memory.capture``)."""
    check_codec(codec)
    return _encode(rows, codec)


def take(memory: RecurrentMemory, seq_id: int, codec: str = "exact") -> Checkpoint | None:
    """A copy of ``seq_id``'s state, or None when the sequence holds none."""
    check_codec(codec)
    memory.require_seq(seq_id, "checkpoint")
    cell = memory.cells.tail[seq_id]
    if cell < 0:
        return None
    r_rows = tuple(None if t is None else _encode(t[cell : cell + 1], codec) for t in memory.r_l)
    s_rows = tuple(None if t is None else _encode(t[cell : cell + 1], codec) for t in memory.s_l)
    return Checkpoint(memory.cells.pos[cell], codec, r_rows, s_rows)


def restore(memory: RecurrentMemory, checkpoint: Checkpoint, seq_id: int) -> None:
    """Make ``checkpoint`` ``seq_id``'s state (its old state is dropped); raises NoSlotError, with the
    memory unchanged, if no cell is free."""
    r_rows = [None if e is None else _decode(e) for e in checkpoint.r_rows]
    s_rows = [None if e is None else _decode(e) for e in checkpoint.s_rows]
    if len(r_rows) != memory.n_layer or any(
        (t is None) != (row is None) or (row is not None and t is not None and row.shape[1] != t.shape[1])
        for t, row in zip((*memory.r_l, *memory.s_l), (*r_rows, *s_rows), strict=True)
    ):
        raise ValueError("the checkpoint was taken from a memory of another shape")
    restore_payload(memory, Payload([(checkpoint.pos, ())], r_rows, s_rows), seq_id)


def _encode(rows: torch.Tensor, codec: str) -> Encoded:
    shape, dtype = tuple(rows.shape), rows.dtype
    if codec == "exact":
        return Encoded(rows.clone(), None, shape, dtype)
    if codec == "bf16":
        return Encoded(rows.to(torch.bfloat16), None, shape, dtype)
    flat = rows.reshape(-1).to(torch.float32)
    pad = (-flat.numel()) % INT8_BLOCK
    blocks = torch.nn.functional.pad(flat, (0, pad)).view(-1, INT8_BLOCK)
    scales = blocks.abs().amax(dim=1) / 127.0
    q = torch.round(blocks / torch.where(scales > 0, scales, 1.0).unsqueeze(1)).to(torch.int8)
    return Encoded(q, scales, shape, dtype)


def _decode(e: Encoded) -> torch.Tensor:
    if e.scales is None:
        return e.data.to(e.dtype)
    n = 1
    for d in e.shape:
        n *= d
    values = (e.data.to(torch.float32) * e.scales.unsqueeze(1)).reshape(-1)[:n]
    return values.reshape(e.shape).to(e.dtype)
