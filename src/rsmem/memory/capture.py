"""Checkpoints captured inside a micro-batch: states at chosen positions, without ending the chunk there.

A capture request maps a sequence id to token counts ``n``: "the state after this sequence's token at
position ``n - 1``". For each micro-batch, :func:`plan_ubatch` finds the requested positions it holds, as
points ``(s, t)``: sequence set ``s`` after its token ``t`` (an offset in the micro-batch). Points at a
set's last token are read from the memory after the forward (:func:`take_at`: the cell holds that state);
the others, the *inner* points, go to a model that emits them from its own pass (one whose ``forward``
takes a ``capture`` argument, :func:`accepts_capture`: it hands each layer's states at ``capture.points``
to ``capture.keep``, a :class:`UBatchCapture`), or, for any other model (or a wrapper whose ``forward``
does not pass it on), the micro-batch is run as column slices ending at the points
(:func:`column_slices`) and each is read from the memory like a last token.

Every checkpoint has the ``pos`` and rows :func:`~rsmem.memory.checkpoint.take` would have recorded had
the chunk ended at its position (rows in the memory's dtype, then in the codec).
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from rsmem.batch.batch import UBatch
from rsmem.memory.checkpoint import Checkpoint, Encoded, encode, take
from rsmem.memory.recurrent import RecurrentMemory

CaptureRequest = Mapping[int, Collection[int]]  # sequence id -> token counts n (state after position n-1)
CaptureKey = tuple[int, int]  # (sequence id, n), as requested
Point = tuple[int, int]  # (sequence set in the micro-batch, token offset in it)


class StateCapture(Protocol):
    """What a capturing model's forward receives: where states are wanted, and where they go."""

    @property
    def points(self) -> Sequence[Point]:
        """``(s, t)``: sequence set ``s`` of the micro-batch after its token ``t`` (never its last)."""
        ...

    def keep(self, il: int, r_rows: torch.Tensor, s_rows: torch.Tensor) -> None:
        """Layer ``il``'s states at the points, one row per point in :attr:`points` order:
        ``[len(points), n_embd_r]`` and ``[len(points), n_embd_s]`` (any float dtype)."""
        ...


@dataclass(frozen=True, slots=True)
class UBatchPlan:
    """The captures one micro-batch holds: distinct points, sorted, each with its position (the
    checkpoint's ``pos``) and the requested keys it answers (several when sequences share a set)."""

    points: tuple[Point, ...]
    pos: tuple[int, ...]
    keys: tuple[tuple[CaptureKey, ...], ...]
    n_seq_tokens: int

    def inner(self) -> list[int]:
        """Indices of the points before their set's last token."""
        return [i for i, (_, t) in enumerate(self.points) if t < self.n_seq_tokens - 1]

    def ending_at(self, t: int) -> list[int]:
        """Indices of the points after token ``t``."""
        return [i for i, (_, tt) in enumerate(self.points) if tt == t]


def accepts_capture(model: object) -> bool:
    """Whether ``model.forward`` takes a ``capture`` argument (Mamba, Mamba-2; not a subclass or wrapper
    whose own ``forward(ubatch, states)`` would drop it)."""
    forward = getattr(model, "forward", None)
    try:
        return forward is not None and "capture" in inspect.signature(forward).parameters
    except (TypeError, ValueError):  # no signature to read
        return False


def plan_ubatch(ubatch: UBatch, request: CaptureRequest) -> UBatchPlan | None:
    """The points of ``request`` inside ``ubatch`` (None when there are none)."""
    n_tok = ubatch.n_seq_tokens
    found: dict[Point, list[CaptureKey]] = {}
    for s in range(ubatch.n_seqs):
        wanted = [(seq, n) for seq in ubatch.seq_set(s) for n in request.get(seq, ())]
        if not wanted:
            continue
        offset = {p: t for t, p in enumerate(ubatch.pos[s * n_tok : (s + 1) * n_tok])}
        for seq, n in wanted:
            t = offset.get(n - 1)
            if t is not None:
                found.setdefault((s, t), []).append((seq, n))
    if not found:
        return None
    points = tuple(sorted(found))
    return UBatchPlan(
        points=points,
        pos=tuple(ubatch.pos[s * n_tok + t] for s, t in points),
        keys=tuple(tuple(found[p]) for p in points),
        n_seq_tokens=n_tok,
    )


def column_slices(ubatch: UBatch, ends: Collection[int]) -> list[UBatch]:
    """``ubatch`` cut into consecutive micro-batches of the same sequence sets, one ending after each token
    offset of ``ends`` (and one at the end): how a model that cannot capture still gets its points."""
    n_tok = ubatch.n_seq_tokens
    bounds = [0, *sorted({t + 1 for t in ends if 0 <= t < n_tok - 1}), n_tok]
    if len(bounds) == 2:
        return [ubatch]
    slices = []
    for a, b in itertools.pairwise(bounds):
        idx = [s * n_tok + t for s in range(ubatch.n_seqs) for t in range(a, b)]
        slices.append(
            UBatch(
                tokens=tuple(ubatch.tokens[i] for i in idx),
                pos=tuple(ubatch.pos[i] for i in idx),
                seq_ids=tuple(ubatch.seq_ids[i] for i in idx),
                outputs=tuple(ubatch.outputs[i] for i in idx),
                batch_index=tuple(ubatch.batch_index[i] for i in idx),
                n_seqs=ubatch.n_seqs,
                n_seq_tokens=b - a,
                equal_seqs=ubatch.equal_seqs,
            )
        )
    return slices


def take_at(memory: RecurrentMemory, ubatch: UBatch, s: int, pos: int, codec: str) -> Checkpoint:
    """The checkpoint of sequence set ``s``'s cell, which holds its state after position ``pos`` (the
    micro-batch, or the slice of it, that ended there was just run)."""
    with torch.inference_mode(False):  # ordinary tensors, as a take outside a decode gives
        ckpt = take(memory, ubatch.seq_set(s)[0], codec)
    if ckpt is None:
        raise RuntimeError("a sequence of the micro-batch holds no cell after its forward (bookkeeping bug)")
    return dataclasses.replace(ckpt, pos=pos)


class UBatchCapture:
    """The :class:`StateCapture` a capturing model fills for one micro-batch: rows are converted to the
    memory's dtype (as ``write_states`` would store them) and encoded as they arrive."""

    def __init__(self, memory: RecurrentMemory, points: Sequence[Point], codec: str) -> None:
        self._points = tuple(points)
        self._memory = memory
        self._codec = codec
        n_layer = memory.n_layer
        self._r: list[list[Encoded] | None] = [None] * n_layer
        self._s: list[list[Encoded] | None] = [None] * n_layer

    @property
    def points(self) -> Sequence[Point]:
        return self._points

    def keep(self, il: int, r_rows: torch.Tensor, s_rows: torch.Tensor) -> None:
        r_mem, s_mem = self._memory.r_l[il], self._memory.s_l[il]
        if r_mem is None or s_mem is None:
            raise ValueError(f"layer {il} has no recurrent state in this memory")
        n = len(self._points)
        for rows, mem in ((r_rows, r_mem), (s_rows, s_mem)):
            if rows.shape != (n, mem.shape[1]):
                raise ValueError(f"layer {il}: rows of shape {tuple(rows.shape)}, wanted {(n, mem.shape[1])}")
        with torch.inference_mode(False):  # ordinary tensors, as a take outside a decode gives
            r_rows, s_rows = r_rows.to(r_mem.dtype), s_rows.to(s_mem.dtype)
            self._r[il] = [encode(r_rows[k : k + 1], self._codec) for k in range(n)]
            self._s[il] = [encode(s_rows[k : k + 1], self._codec) for k in range(n)]

    def checkpoints(self, pos: Sequence[int]) -> list[Checkpoint]:
        """One checkpoint a point, with positions ``pos``; raises if a held layer was not kept."""
        held = [il for il, t in enumerate(self._memory.r_l) if t is not None]
        missing = [il for il in held if self._r[il] is None]
        if missing:
            raise RuntimeError(f"the model kept no states at the capture points for layers {missing}")

        def rows(layers: list[list[Encoded] | None], k: int) -> tuple[Encoded | None, ...]:
            return tuple(None if ly is None else ly[k] for ly in layers)

        return [Checkpoint(p, self._codec, rows(self._r, k), rows(self._s, k)) for k, p in enumerate(pos)]
