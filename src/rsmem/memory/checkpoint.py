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

A hybrid memory's checkpoint (:class:`~rsmem.memory.hybrid.HybridMemory`) is the recurrent rows plus the
sequence's KV prefix (:class:`KVRows`: the positions and K/V rows of every KV cell it sees, in position
order, in the same codec; counted in ``nbytes``). ``restore`` releases the destination's KV cells and
recurrent cell and writes both parts into fresh cells, into the same sequence or another one, after a
dry run of both placements. Copying the K/V rows rather than sharing cells (``seq_cp``) keeps one rule for
every case: per-sequence streams cannot share cells across sequences, and a shared cell would outlive a
source sequence that later changes; the copy costs ``kv_bytes_per_token`` per position, far below
recomputing those positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rsmem.errors import NoSlotError
from rsmem.memory.hybrid import HybridMemory, HybridState
from rsmem.memory.kv_state import KVStream, can_restore_kv
from rsmem.memory.protocol import SequenceMemory
from rsmem.memory.recurrent import RecurrentMemory
from rsmem.memory.state_io import Payload, can_install, restore_payload

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
class KVRows:
    """A sequence's KV prefix: its cells' positions (ascending) and, per attention layer in the cache's
    layer order, their K and V rows ``[n, n_embd]``."""

    positions: tuple[int, ...]
    k: tuple[Encoded, ...]
    v: tuple[Encoded, ...]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in (*self.k, *self.v))


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """``seq``'s state after position ``pos`` (the last token folded in), in ``codec``; ``kv``: a hybrid
    memory's KV prefix (None for a recurrent memory)."""

    pos: int
    codec: str
    r_rows: tuple[Encoded | None, ...]
    s_rows: tuple[Encoded | None, ...]
    kv: KVRows | None = None

    def _encoded(self) -> list[Encoded]:
        kv = () if self.kv is None else (*self.kv.k, *self.kv.v)
        return [e for e in (*self.r_rows, *self.s_rows, *kv) if e is not None]

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self._encoded())

    def is_finite(self) -> bool:
        """No NaN or inf in any row (int8 rows are finite when their scales are).

        Each row is summed (a NaN or inf in it makes its sum so): one pass without the boolean tensor of
        ``isfinite(...).all()``, so much the cheaper. A finite row whose float32 sum
        overflows (values near 1e38, which no model's state holds) counts as not finite: only ever a
        refusal, never a broken state let through."""
        sums = [(e.data if e.scales is None else e.scales).sum(dtype=torch.float32) for e in self._encoded()]
        return bool(torch.isfinite(torch.stack(sums)).all()) if sums else True  # one read back


def check_codec(codec: str) -> None:
    """Raise ValueError unless ``codec`` is one of :data:`CODECS`."""
    if codec not in CODECS:
        raise ValueError(f"unknown checkpoint codec {codec!r}: use one of {', '.join(CODECS)}")


def encode(rows: torch.Tensor, codec: str) -> Encoded:
    """One layer's state rows (``[1, n_embd]`` in the memory's dtype) in ``codec``, as :func:`take` keeps
    them: for builders of checkpoints from rows that are not a cell's (``rsmem.memory.capture``)."""
    check_codec(codec)
    return _encode(rows, codec)


def take(memory: SequenceMemory, seq_id: int, codec: str = "exact") -> Checkpoint | None:
    """A copy of ``seq_id``'s state (with a hybrid's KV prefix), or None when the sequence holds none."""
    check_codec(codec)
    memory.require_seq(seq_id, "checkpoint")
    if isinstance(memory, HybridMemory):
        ckpt = _take_recurrent(memory.recurrent, seq_id, codec)
        if ckpt is None or memory.kv.seq_pos_max(seq_id) < ckpt.pos:
            return None  # no state, or the KV cache lacks positions the recurrent state folded
        return Checkpoint(
            ckpt.pos, codec, ckpt.r_rows, ckpt.s_rows, _take_kv(memory, seq_id, ckpt.pos, codec)
        )
    if not isinstance(memory, RecurrentMemory):
        raise TypeError(f"checkpoints of a {type(memory).__name__} are not supported")
    return _take_recurrent(memory, seq_id, codec)


def _take_recurrent(memory: RecurrentMemory, seq_id: int, codec: str) -> Checkpoint | None:
    cell = memory.cells.tail[seq_id]
    if cell < 0:
        return None
    r_rows = tuple(None if t is None else _encode(t[cell : cell + 1], codec) for t in memory.r_l)
    s_rows = tuple(None if t is None else _encode(t[cell : cell + 1], codec) for t in memory.s_l)
    return Checkpoint(memory.cells.pos[cell], codec, r_rows, s_rows)


def _take_kv(memory: HybridMemory, seq_id: int, pos: int, codec: str) -> KVRows:
    """``seq_id``'s KV cells up to position ``pos``, in position order."""
    kv = memory.kv
    kv.update()  # pending position shifts go into the keys first
    cells = kv.cells_of_seq(seq_id)
    idx = sorted(
        (i for i in range(cells.size) if seq_id in cells.seqs[i] and 0 <= cells.pos[i] <= pos),
        key=lambda i: cells.pos[i],
    )
    st = kv.stream_of(seq_id)
    index = torch.tensor(idx, dtype=torch.long, device=kv.device)
    k = tuple(_encode(kv.k_l[il][st].index_select(0, index), codec) for il in kv.layer_dims)
    v = tuple(_encode(kv.v_l[il][st].index_select(0, index), codec) for il in kv.layer_dims)
    return KVRows(tuple(cells.pos[i] for i in idx), k, v)


def restore(memory: SequenceMemory, checkpoint: Checkpoint, seq_id: int) -> None:
    """Make ``checkpoint`` ``seq_id``'s state (its old state is dropped); raises NoSlotError, with the
    memory unchanged, if no cell is free, and ValueError if the checkpoint is of another memory's shape."""
    if isinstance(memory, HybridMemory):
        _restore_hybrid(memory, checkpoint, seq_id)
        return
    if not isinstance(memory, RecurrentMemory):
        raise TypeError(f"checkpoints of a {type(memory).__name__} are not supported")
    if checkpoint.kv is not None:
        raise ValueError("the checkpoint was taken from a hybrid memory (it holds KV rows)")
    restore_payload(memory, _payload(memory, checkpoint), seq_id)


def _restore_hybrid(memory: HybridMemory, checkpoint: Checkpoint, seq_id: int) -> None:
    kv, rows = memory.kv, checkpoint.kv
    if rows is None or len(rows.k) != len(kv.layer_dims) or len(rows.v) != len(kv.layer_dims):
        raise ValueError("the checkpoint was not taken from a hybrid memory of this shape (KV rows)")
    memory.require_seq(seq_id, "checkpoint restore")
    payload = _payload(memory.recurrent, checkpoint)
    k = {il: _decode(e) for il, e in zip(kv.layer_dims, rows.k, strict=True)}
    v = {il: _decode(e) for il, e in zip(kv.layer_dims, rows.v, strict=True)}
    if any(
        k[il].shape != (len(rows.positions), dk) or v[il].shape != (len(rows.positions), dv)
        for il, (dk, dv) in kv.layer_dims.items()
    ):
        raise ValueError("the checkpoint's KV rows do not fit this cache's attention layers")
    streams = _kv_streams(memory, rows, seq_id, k, v)
    if not can_restore_kv(kv, streams, seq_id) or not can_install(memory.recurrent, seq_id):
        raise NoSlotError(f"no free cells to restore a checkpoint into sequence {seq_id}")
    memory.install_state(HybridState(streams, payload), seq_id)


def _kv_streams(
    memory: HybridMemory,
    rows: KVRows,
    seq_id: int,
    k: dict[int, torch.Tensor],
    v: dict[int, torch.Tensor],
) -> list[KVStream]:
    """The KV part of a restore of ``rows`` into ``seq_id`` (none for an empty prefix)."""
    cells: list[tuple[int, tuple[int, ...]]] = [(p, (seq_id,)) for p in rows.positions]
    return [KVStream(memory.kv.stream_of(seq_id), cells, k, v)] if cells else []


def fits(memory: SequenceMemory, checkpoint: Checkpoint, seq_id: int) -> bool:
    """Whether :func:`restore` would find cells for ``checkpoint`` in ``seq_id`` now (a dry run: nothing
    changes; the rows are not decoded)."""
    memory.require_seq(seq_id, "checkpoint restore")
    if isinstance(memory, HybridMemory):
        if checkpoint.kv is None:
            return False
        streams = _kv_streams(memory, checkpoint.kv, seq_id, {}, {})
        return can_restore_kv(memory.kv, streams, seq_id) and can_install(memory.recurrent, seq_id)
    if not isinstance(memory, RecurrentMemory):
        raise TypeError(f"checkpoints of a {type(memory).__name__} are not supported")
    return can_install(memory, seq_id)


def _payload(memory: RecurrentMemory, checkpoint: Checkpoint) -> Payload:
    """The recurrent rows of ``checkpoint`` as a payload for ``memory``, checked against its shape."""
    r_rows = [None if e is None else _decode(e) for e in checkpoint.r_rows]
    s_rows = [None if e is None else _decode(e) for e in checkpoint.s_rows]
    if len(r_rows) != memory.n_layer or any(
        (t is None) != (row is None) or (row is not None and t is not None and row.shape[1] != t.shape[1])
        for t, row in zip((*memory.r_l, *memory.s_l), (*r_rows, *s_rows), strict=True)
    ):
        raise ValueError("the checkpoint was taken from a memory of another shape")
    return Payload([(checkpoint.pos, ())], r_rows, s_rows)


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
