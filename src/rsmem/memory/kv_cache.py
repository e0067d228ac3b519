"""The attention KV cache: llama.cpp's ``llama_kv_cache`` for Python.

Each attention layer keeps one K row and one V row per cell. Cells live in streams: with ``unified`` one
stream of ``kv_size`` cells is shared by every sequence (llama.cpp's ``kv_unified``); otherwise sequence
``s`` has stream ``s`` of its own (``kv_size`` cells each, llama.cpp's default). A cell holds a position
and the set of sequences that see it (:class:`~rsmem.memory.kv_cells.KVCells`), so ``seq_cp`` inside a
stream shares cells instead of copying rows; across streams it copies the whole stream, as llama.cpp does.

Sequence operations keep llama.cpp's semantics and return values: ``seq_rm`` removes any range (an
attention cache can forget a suffix) and returns True; ``seq_add`` / ``seq_div`` move positions (a cell
moved below 0 is freed) and record the change, which a RoPE model applies to its stored keys before the
next step (``set_k_shift``, :meth:`KVCache.update`). Deliberate differences: an unknown seq id raises
UnknownSequenceError (llama.cpp asserts); ``seq_keep`` drops the other sequences in every stream
(llama.cpp only clears the kept sequence's own stream, leaving other streams' sequences attendable);
``seq_cp`` between streams copies the rows at once (llama.cpp defers the copy to the next update);
a cross-stream ``seq_cp`` of a partial range raises ValueError (llama.cpp aborts); no sliding window.

Placement is plan-then-commit: :meth:`KVCache.prepare` dry-runs ``find_slot`` + ``apply_ubatch`` for
every micro-batch and puts the touched cells back; only the memory context's ``apply`` changes the cells.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from rsmem.batch.allocator import BatchAllocator
from rsmem.batch.batch import UBatch
from rsmem.errors import UnknownSequenceError
from rsmem.memory.context import MemoryStatus
from rsmem.memory.kv_attention import KVCacheContext
from rsmem.memory.kv_cells import CellRecord, KVCells, SlotInfo

POS_MAX = 2**31 - 1
KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# K-shift: (layer, K rows [n, n_embd_k] as stored, position deltas [n]) -> the rows re-rotated
KShift = Callable[[int, torch.Tensor, torch.Tensor], torch.Tensor]


class KVCache:
    """K/V rows of the attention layers for ``n_seq_max`` sequences, with llama.cpp's sequence operations.

    ``layers`` maps each attention layer to ``(n_embd_k_gqa, n_embd_v_gqa)`` (values per cell);
    ``kv_size`` is the cells of one stream; ``v_trans`` is how state bytes store V (llama.cpp transposes
    it unless flash attention is on), it does not change the tensors here. ``cell_ext``: each cell also
    keeps the token stored there (``cell_tok``; -1 when unknown), which state bytes carry as llama.cpp's
    ``llama_kv_cell_ext`` (models with M-RoPE, e.g. Qwen3.5)."""

    def __init__(
        self,
        layers: Mapping[int, tuple[int, int]],
        kv_size: int,
        n_seq_max: int = 1,
        *,
        unified: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        v_trans: bool = True,
        cell_ext: bool = False,
    ) -> None:
        if dtype not in KV_DTYPES:
            raise ValueError(f"KV dtype must be float32, float16 or bfloat16, got {dtype}")
        if kv_size < 1:
            raise ValueError(f"kv_size must be positive, got {kv_size}")
        self.n_seq_max = max(1, n_seq_max)
        self.unified = unified
        self.n_stream = 1 if unified else self.n_seq_max
        self.size = kv_size
        self.dtype = dtype
        self.device = torch.device(device)
        self.v_trans = v_trans
        self.layer_dims = dict(sorted(layers.items()))
        shape = (self.n_stream, kv_size)
        self.k_l = {
            il: torch.zeros(*shape, nk, dtype=dtype, device=self.device) for il, (nk, _) in layers.items()
        }
        self.v_l = {
            il: torch.zeros(*shape, nv, dtype=dtype, device=self.device) for il, (_, nv) in layers.items()
        }
        self.streams = [KVCells(kv_size) for _ in range(self.n_stream)]
        self.heads = [0] * self.n_stream
        self.k_shift: KShift | None = None
        self.cell_ext = cell_ext
        self.cell_tok = [[-1] * kv_size for _ in range(self.n_stream)] if cell_ext else []

    # ----------------------------------------------------------------- sizes

    def size_k_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k_l.values())

    def size_v_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.v_l.values())

    def total_size(self) -> int:
        return self.size_k_bytes() + self.size_v_bytes()

    def bytes_per_token(self) -> int:
        """K and V bytes one cell takes over all attention layers."""
        return self.total_size() // (self.n_stream * self.size)

    # -------------------------------------------------------------- streams

    def require_seq(self, seq_id: int, what: str) -> None:
        if not 0 <= seq_id < self.n_seq_max:
            raise UnknownSequenceError(f"{what}: seq_id {seq_id} is outside [0, {self.n_seq_max})")

    def stream_of(self, seq_id: int) -> int:
        return 0 if self.unified else seq_id

    def cells_of_seq(self, seq_id: int) -> KVCells:
        """The stream ``seq_id`` lives in (read it; change it only through this class)."""
        self.require_seq(seq_id, "cells")
        return self.streams[self.stream_of(seq_id)]

    def seq_pos_min(self, seq_id: int) -> int:
        return self.cells_of_seq(seq_id).seq_pos_min(seq_id)

    def seq_pos_max(self, seq_id: int) -> int:
        return self.cells_of_seq(seq_id).seq_pos_max(seq_id)

    # ---------------------------------------------------- sequence operations

    def clear(self, data: bool = True) -> None:
        for cells in self.streams:
            cells.reset()
        self.heads = [0] * self.n_stream
        if data:
            for t in (*self.k_l.values(), *self.v_l.values()):
                t.zero_()

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """Remove positions ``[p0, p1)`` of a sequence (of every sequence when ``seq_id < 0``); cells no
        sequence sees any more are freed. True, except for a seq id ``>= n_seq_max`` (False)."""
        if seq_id >= self.n_seq_max:
            return False
        p0, p1 = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        targets = range(self.n_stream) if seq_id < 0 else [self.stream_of(seq_id)]
        for st in targets:
            cells = self.streams[st]
            new_head = cells.size
            for i in range(cells.size):
                if not p0 <= cells.pos[i] < p1:
                    continue
                if seq_id < 0:
                    cells.rm(i)
                    freed = True
                elif seq_id in cells.seqs[i]:
                    freed = cells.seq_rm(i, seq_id)
                else:
                    continue
                if freed and new_head == cells.size:
                    new_head = i
            if new_head < self.heads[st]:
                self.heads[st] = new_head
        return True

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        """Let ``dst`` see ``src``'s cells in ``[p0, p1)``: shared cells in one stream; across streams the
        whole range only (ValueError otherwise, nothing changed), with the rows copied."""
        self.require_seq(seq_id_src, "seq_cp source")
        self.require_seq(seq_id_dst, "seq_cp destination")
        s0, s1 = self.stream_of(seq_id_src), self.stream_of(seq_id_dst)
        if s0 == s1:
            if seq_id_src == seq_id_dst:
                return
            p0, p1 = max(p0, 0), (POS_MAX if p1 < 0 else p1)
            cells = self.streams[s0]
            for i in range(cells.size):
                if p0 <= cells.pos[i] < p1 and seq_id_src in cells.seqs[i]:
                    cells.seq_add(i, seq_id_dst)
            return
        if (p0 > 0 and p0 + 1 < self.size) or (p1 > 0 and p1 + 1 < self.size):
            raise ValueError(
                f"seq_cp({seq_id_src}, {seq_id_dst}, {p0}, {p1}): sequences in different streams can only "
                "be copied whole (p0 = p1 = -1)"
            )
        src, dst = self.streams[s0], self.streams[s1]
        dst.reset()
        for i in range(src.size):
            if seq_id_src in src.seqs[i]:
                dst.occupy(i, src.pos[i], {seq_id_dst})
                dst.shift[i] = src.shift[i]
        self.heads[s1] = self.heads[s0]
        if self.cell_ext:
            self.cell_tok[s1] = list(self.cell_tok[s0])
        for t in (*self.k_l.values(), *self.v_l.values()):
            t[s1].copy_(t[s0])

    def seq_keep(self, seq_id: int) -> None:
        """Drop every other sequence (in every stream)."""
        self.require_seq(seq_id, "seq_keep")
        for st, cells in enumerate(self.streams):
            new_head = cells.size
            for i in range(cells.size):
                if cells.seq_keep(i, seq_id) and new_head == cells.size:
                    new_head = i
            if new_head < self.heads[st]:
                self.heads[st] = new_head

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """Move the sequence's positions in ``[p0, p1)`` by ``shift`` (for every sequence sharing those
        cells); a cell moved below 0 is freed."""
        self.require_seq(seq_id, "seq_add")
        if shift == 0:
            return
        p0, p1 = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        if p0 == p1:
            return
        st = self.stream_of(seq_id)
        cells = self.streams[st]
        new_head = cells.size
        for i in range(cells.size):
            moved = p0 <= cells.pos[i] < p1 and seq_id in cells.seqs[i]
            if moved and cells.pos_add(i, shift) and new_head == cells.size:
                new_head = i
        self.heads[st] = new_head if new_head != cells.size else 0

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        """Divide the sequence's positions in ``[p0, p1)`` by ``d`` (integer division)."""
        self.require_seq(seq_id, "seq_div")
        if d <= 0:
            raise ValueError(f"seq_div: divisor must be positive, got {d}")
        p0, p1 = max(p0, 0), (POS_MAX if p1 < 0 else p1)
        if d == 1 or p0 == p1:
            return
        cells = self.streams[self.stream_of(seq_id)]
        for i in range(cells.size):
            if p0 <= cells.pos[i] < p1 and seq_id in cells.seqs[i]:
                cells.pos_div(i, d)

    # ------------------------------------------------------------- K-shift

    def set_k_shift(self, fn: KShift | None) -> None:
        """How stored keys follow a position change (a RoPE model's re-rotation); None: they need not."""
        self.k_shift = fn

    def has_shift(self) -> bool:
        return any(cells.has_shift() for cells in self.streams)

    def update(self) -> None:
        """Apply pending position changes to the stored keys (llama.cpp's K-shift), then forget them."""
        if not self.has_shift():
            return
        for st, cells in enumerate(self.streams):
            idx = [i for i in range(cells.size) if cells.pos[i] >= 0 and cells.shift[i]]
            if idx and self.k_shift is not None:
                index = torch.tensor(idx, dtype=torch.long, device=self.device)
                delta = torch.tensor([cells.shift[i] for i in idx], dtype=torch.long, device=self.device)
                for il, k in self.k_l.items():
                    rows = k[st].index_select(0, index).float()
                    k[st].index_copy_(0, index, self.k_shift(il, rows, delta).to(k.dtype))
            cells.reset_shift()

    # ------------------------------------------------------------ placement

    def find_slot(self, ubatch: UBatch) -> SlotInfo | None:
        """Cells for the micro-batch's tokens, without changing anything: per stream it touches, the first
        empty cells in circular order from the stream's head (llama.cpp's non-contiguous search). None if
        a stream has too few empty cells, or (several streams) a token is in several sequences."""
        if self.unified:
            spans = [(0, 0, ubatch.n_tokens)]
        else:
            n = ubatch.n_seq_tokens if ubatch.equal_seqs else 1
            spans = []
            for g in range(ubatch.n_tokens // n):
                ids = ubatch.seq_ids[g * n]
                if len(ids) != 1 or any(ubatch.seq_ids[g * n + t] != ids for t in range(n)):
                    return None
                spans.append((self.stream_of(ids[0]), g * n, n))
            if len({st for st, _, _ in spans}) != len(spans):
                return None
        groups: list[tuple[int, list[int]]] = []
        for st, _, n in spans:
            cells = self.streams[st]
            head = self.heads[st]
            if head > cells.n_used + 2 * n:
                head = 0
            if n > cells.size:
                return None
            order = (i for r in (range(head, cells.size), range(head)) for i in r)
            idxs = []
            for i in order:
                if cells.pos[i] < 0:
                    idxs.append(i)
                    if len(idxs) == n:
                        break
            if len(idxs) < n:
                return None
            groups.append((st, idxs))
        return SlotInfo(groups)

    def apply_ubatch(self, sinfo: SlotInfo, ubatch: UBatch) -> None:
        """Store the micro-batch's positions and sequences in the cells ``sinfo`` found."""
        n = sinfo.n_per_group
        for g, (st, idxs) in enumerate(sinfo.groups):
            cells = self.streams[st]
            for ii, i in enumerate(idxs):
                t = g * n + ii
                if cells.pos[i] >= 0:
                    cells.rm(i)
                cells.occupy(i, ubatch.pos[t], set(ubatch.seq_ids[t]))
                if self.cell_ext:
                    self.cell_tok[st][i] = ubatch.tokens[t]
            self.heads[st] = idxs[-1] + 1

    def prepare(self, ubatches: Sequence[UBatch]) -> list[SlotInfo] | None:
        """Dry-run the placement of every micro-batch in order; the cells are put back afterwards. The
        slots found, or None if one micro-batch does not fit."""
        undo: list[tuple[SlotInfo, list[int], list[list[CellRecord]]]] = []
        found: list[SlotInfo] = []
        try:
            for ub in ubatches:
                sinfo = self.find_slot(ub)
                if sinfo is None:
                    return None
                saved = [self.streams[st].snapshot(idxs) for st, idxs in sinfo.groups]
                undo.append((sinfo, list(self.heads), saved))
                self.apply_ubatch(sinfo, ub)
                found.append(sinfo)
            return found
        finally:
            for sinfo, heads, saved in reversed(undo):
                for (st, idxs), records in zip(sinfo.groups, saved, strict=True):
                    self.streams[st].restore(idxs, records)
                self.heads = heads

    def init_batch(self, balloc: BatchAllocator, n_ubatch: int) -> KVCacheContext:
        """Split the batch (in order when unified, equal per sequence otherwise) and dry-run its
        placement: a context with status FAILED_PREPARE when it does not fit (the cache unchanged)."""
        balloc.split_reset()
        ubatches: list[UBatch] = []
        while True:
            ub = balloc.split_simple(n_ubatch) if self.unified else balloc.split_equal(n_ubatch, False)
            if ub is None:
                break
            ubatches.append(ub)
        sinfos = self.prepare(ubatches) if balloc.n_used == balloc.n_tokens else None
        if sinfos is None:
            return KVCacheContext(self, [], [], MemoryStatus.FAILED_PREPARE)
        return KVCacheContext(self, ubatches, sinfos, MemoryStatus.SUCCESS)

    # ------------------------------------------------------------ invariants

    def check_invariants(self) -> None:
        for st, cells in enumerate(self.streams):
            cells.check()
            if not self.unified:
                for i in range(cells.size):
                    assert cells.seqs[i] <= {st}, f"stream {st} cell {i} holds sequences {cells.seqs[i]}"
