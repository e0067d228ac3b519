"""The KV cache's plan for one batch (llama.cpp's ``llama_kv_cache_context``), and attention over it.

A model's attention layer hands its queries, keys and values for the micro-batch's tokens to
:meth:`KVCacheContext.attention`: the keys and values are stored in the cells ``apply`` placed, then each
token attends to the cells of its own sequence (its first seq id) at positions up to its own (llama.cpp's
causal KQ mask), through ``torch.nn.functional.scaled_dot_product_attention`` with that boolean mask.
Tokens of each stream the micro-batch touches are one batch row of the product, over the stream's cells up
to the last used one; when each token sees few of them (a decode step of several sequences in one unified
stream: each sees its own cells, a fraction of the stream), each token is a batch row of its own over the
K/V rows of its visible cells, gathered (:func:`gathered_cells`), so the work is that of the cells each
sequence holds, not of all the sequences' cells.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from rsmem.batch.batch import UBatch
from rsmem.memory.context import MemoryStatus
from rsmem.memory.kv_cells import SlotInfo, visible
from rsmem.threads import one_thread_below

if TYPE_CHECKING:
    from rsmem.memory.kv_cache import KVCache


class KVCacheContext:
    """Micro-batches planned for the KV cache, applied one at a time."""

    def __init__(
        self, cache: KVCache, ubatches: list[UBatch], sinfos: list[SlotInfo], status: MemoryStatus
    ) -> None:
        self.cache = cache
        self.ubatches = ubatches
        self.sinfos = sinfos
        self.status = status
        self._i = 0
        self._mask: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._compact: tuple[Gathered | None] | None = None  # (gathered cells of the micro-batch,)
        self._bias: torch.Tensor | None = None  # additive(mask())

    @property
    def ubatch(self) -> UBatch:
        return self.ubatches[self._i]

    @property
    def sinfo(self) -> SlotInfo:
        return self.sinfos[self._i]

    def apply(self) -> bool:
        """Apply pending position shifts to the keys (before the first micro-batch), then place the
        current micro-batch in its cells (the dry run found them)."""
        if self.status is not MemoryStatus.SUCCESS:
            raise RuntimeError(f"cannot apply a KV cache context with status {self.status.name}")
        if self._i == 0:
            self.cache.update()
        self.cache.apply_ubatch(self.sinfo, self.ubatch)
        self._mask = self._index = self._compact = self._bias = None
        return True

    def next(self) -> bool:
        self._i += 1
        self._mask = self._index = self._compact = self._bias = None
        return self._i < len(self.ubatches)

    # ------------------------------------------------------------ attention

    def n_kv(self) -> int:
        """Cells attention reads in each stream of the micro-batch: up to the last used one."""
        return max(self.cache.streams[st].used_max_p1() for st, _ in self.sinfo.groups)

    def _row_index(self) -> torch.Tensor:
        """Flat row (``stream * size + cell``) of each token of the micro-batch, in micro-batch order."""
        if self._index is None:
            size = self.cache.size
            rows = [st * size + i for st, idxs in self.sinfo.groups for i in idxs]
            self._index = torch.tensor(rows, dtype=torch.long, device=self.cache.device)
        return self._index

    def mask(self) -> torch.Tensor:
        """``[n_groups, n_per_group, n_kv]`` bool: token ``t`` of group ``g`` may attend to cell ``j``
        (same sequence, position not after the token's). Built once per micro-batch."""
        if self._mask is not None:
            return self._mask
        ub, n_kv, n = self.ubatch, self.n_kv(), self.sinfo.n_per_group
        masks = []
        for g, (st, _) in enumerate(self.sinfo.groups):
            tokens = range(g * n, (g + 1) * n)
            seqs = [ub.seq_ids[t][0] for t in tokens]
            pos = [ub.pos[t] for t in tokens]
            masks.append(visible(self.cache.streams[st], n_kv, seqs, pos, self.cache.device))
        self._mask = torch.stack(masks).to(self.cache.device)
        return self._mask

    def _streams(self, t: torch.Tensor, n_kv: int) -> torch.Tensor:
        """``t[streams of the micro-batch, :n_kv]``: a view when they are consecutive (one stream, or the
        usual ascending sequences), else a copy."""
        streams = [st for st, _ in self.sinfo.groups]
        if streams == list(range(streams[0], streams[0] + len(streams))):
            return t[streams[0] : streams[0] + len(streams), :n_kv]
        index = torch.tensor(streams, dtype=torch.long, device=t.device)
        return t[:, :n_kv].index_select(0, index)

    def _slice(self, ubatch: UBatch | None) -> torch.Tensor | None:
        """Positions in the placed micro-batch of ``ubatch``'s tokens when it is a column slice of it (a
        Context that runs a micro-batch in parts); None for the whole micro-batch."""
        full = self.ubatch
        if ubatch is None or ubatch is full or ubatch.batch_index == full.batch_index:
            return None
        where = {b: i for i, b in enumerate(full.batch_index)}
        return torch.tensor([where[b] for b in ubatch.batch_index], dtype=torch.long)

    def store_kv(self, il: int, k: torch.Tensor, v: torch.Tensor, ubatch: UBatch | None = None) -> None:
        """Write layer ``il``'s keys and values of the micro-batch's tokens (``[n_tokens, ...]``, micro-batch
        order; or of ``ubatch``'s, a column slice of it) into their cells."""
        k_all, v_all = self.cache.k_l[il], self.cache.v_l[il]
        index = self._row_index()
        part = self._slice(ubatch)
        if part is not None:
            index = index[part.to(index.device)]
        n_tokens = index.numel()
        k_all.view(-1, k_all.shape[-1]).index_copy_(0, index, k.reshape(n_tokens, -1).to(k_all.dtype))
        v_all.view(-1, v_all.shape[-1]).index_copy_(0, index, v.reshape(n_tokens, -1).to(v_all.dtype))

    def attention(
        self,
        il: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        ubatch: UBatch | None = None,
    ) -> torch.Tensor:
        """Store ``k``, ``v`` and attend: ``q`` ``[n_tokens, n_head, d_k]``, ``k`` ``[n_tokens, n_head_kv,
        d_k]``, ``v`` ``[n_tokens, n_head_kv, d_v]``, in micro-batch order. ``ubatch``: the tokens'
        micro-batch when it is a column slice of the placed one (its cells were placed whole; a later
        column's cells are masked out by position). Returns ``[n_tokens, n_head * d_v]`` (float32 when
        ``q`` is)."""
        self.store_kv(il, k, v, ubatch)
        n_head, d_k = q.shape[1], q.shape[2]
        n_head_kv, d_v = v.shape[1], v.shape[2]
        mask = self.mask()
        n_groups, _, n_kv = mask.shape
        part = self._slice(ubatch)
        if (
            part is not None
        ):  # the slice's rows of the mask, still grouped (a slice takes columns of each set)
            mask = mask.reshape(-1, n_kv)[part.to(mask.device)].view(n_groups, -1, n_kv)
        if part is None:
            compact = self._gathered()
        else:
            found = gathered_cells(mask, self._stream_rows())
            compact = None if found is None else (found[0], additive(found[1]))
        if compact is not None:
            return self._attend_gathered(il, q, compact, scale, n_head_kv, d_v)
        n = mask.shape[1]
        bias = self._whole_bias() if part is None else additive(mask)
        keys, values = self._streams(self.cache.k_l[il], n_kv), self._streams(self.cache.v_l[il], n_kv)
        keys = keys.to(q.dtype).view(n_groups, n_kv, n_head_kv, d_k)
        values = values.to(q.dtype).view(n_groups, n_kv, n_head_kv, d_v)
        out = grouped_attention(q.reshape(n_groups, n, n_head, d_k), keys, values, bias, scale)
        return out.reshape(n_groups * n, n_head * d_v)

    def _whole_bias(self) -> torch.Tensor:
        """:func:`additive` of :meth:`mask`, built once per micro-batch."""
        if self._bias is None:
            self._bias = additive(self.mask())
        return self._bias

    # ------------------------------------------------ a decode step's cells, for a C++ step

    def decode_cells(self, ubatch: UBatch | None = None) -> DecodeCells | None:
        """For a float32 cache and ``ubatch`` the whole placed micro-batch: the flat K/V row
        (``stream * size + cell``) each token's keys and values go to, ``[n_tokens]``, and each token's
        visible rows as :func:`visible_rows` gives them (the token's own cell among them: its row is
        written before it is read). None for another dtype or a column slice (the Python attention then)."""
        if self.cache.dtype != torch.float32 or self._slice(ubatch) is not None:
            return None
        index, valid = visible_rows(self.mask(), self._stream_rows())
        return self._row_index(), index, valid

    def layer_rows(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``il``'s keys and values as flat rows ``[streams * size, width]`` (views: a write is the
        cache's)."""
        k_all, v_all = self.cache.k_l[il], self.cache.v_l[il]
        return k_all.view(-1, k_all.shape[-1]), v_all.view(-1, v_all.shape[-1])

    # ------------------------------------------------ attention over gathered cells

    def _stream_rows(self) -> torch.Tensor:
        """Flat row of cell 0 of each group's stream (``stream * size``), ``[n_groups]``."""
        size = self.cache.size
        return torch.tensor([st * size for st, _ in self.sinfo.groups], dtype=torch.long)

    def _gathered(self) -> Gathered | None:
        """:func:`gathered_cells` of the whole micro-batch's mask (validity as :func:`additive`), built once
        per micro-batch."""
        if self._compact is None:
            found = gathered_cells(self.mask(), self._stream_rows())
            self._compact = (None if found is None else (found[0], additive(found[1])),)
        return self._compact[0]

    def _attend_gathered(
        self, il: int, q: torch.Tensor, compact: Gathered, scale: float, n_head_kv: int, d_v: int
    ) -> torch.Tensor:
        """Each token over the K/V rows of its own visible cells only (``compact``: rows and additive mask):
        one batch row a token."""
        index, bias = compact
        n_rows, width = index.shape
        n_head, d_k = q.shape[1], q.shape[2]
        k_all, v_all = self.cache.k_l[il], self.cache.v_l[il]
        flat = index.view(-1).to(k_all.device)
        keys = k_all.view(-1, k_all.shape[-1]).index_select(0, flat).to(q.dtype)
        values = v_all.view(-1, v_all.shape[-1]).index_select(0, flat).to(q.dtype)
        keys, values = keys.view(n_rows, width, n_head_kv, d_k), values.view(n_rows, width, n_head_kv, d_v)
        queries = q.reshape(n_rows, 1, n_head, d_k)
        out = grouped_attention(queries, keys, values, bias[:, None, :], scale)
        return out.reshape(n_rows, n_head * d_v)


# queries a batch row at most for grouped_attention's direct products (more: SDPA's flash kernel)
FEW_QUERIES = 16
# keys a batch row (cells * KV heads * d_k) at most for grouped_attention to take SDPA's kernel with few
# queries too: one op where the grouped products are a dozen, each a dispatch that outweighs the work over
# few keys; over more, SDPA, which reads each KV head once per query head, costs more than the grouped
# products
SDPA_ROW_KEYS = 1 << 18


def additive(mask: torch.Tensor) -> torch.Tensor:
    """A boolean attention mask as the float32 bias :func:`grouped_attention` adds: 0 where allowed, -inf
    elsewhere."""
    return torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))


def grouped_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of ``q`` ``[B, n, H, d_k]`` over ``keys`` ``[B, m, Hkv, d_k]`` and ``values`` ``[B, m, Hkv,
    d_v]`` with the additive mask ``bias`` ``[B, n, m]`` (:func:`additive`); query head ``h`` reads KV head
    ``h // (H / Hkv)``. Returns ``[B, n, H, d_v]``.

    For a few queries a row (decode) the scores are two batched products over the grouped heads, each KV
    head read once for all the query heads that share it (SDPA's CPU kernel reads it once per query
    head, which over long contexts costs more than the two products). For more,
    ``scaled_dot_product_attention`` (which does not build the ``[n, m]`` scores of every head), as for few
    keys a row (:data:`SDPA_ROW_KEYS`), where one op costs less than the grouped products' dozen."""
    n_batch, n, n_head, d_k = q.shape
    n_head_kv, n_rep = keys.shape[2], n_head // keys.shape[2]
    bias = bias.to(q.dtype)
    few_keys = keys.shape[1] * n_head_kv * d_k <= SDPA_ROW_KEYS
    if n > FEW_QUERIES or few_keys:
        work = keys.numel() if n <= FEW_QUERIES else ONE_THREAD_KV  # decode: one thread for little work
        with one_thread_below(work, ONE_THREAD_KV):
            out = F.scaled_dot_product_attention(
                q.transpose(1, 2),
                keys.transpose(1, 2),
                values.transpose(1, 2),
                attn_mask=bias[:, None],
                scale=scale,
                enable_gqa=n_head != n_head_kv,
            )  # [B, H, n, d_v]
        return out.transpose(1, 2)
    with one_thread_below(keys.numel(), ONE_THREAD_KV):
        grouped = q.reshape(n_batch, n, n_head_kv, n_rep, d_k).permute(0, 2, 3, 1, 4)  # [B, Hkv, rep, n, d]
        grouped = grouped.reshape(n_batch, n_head_kv, n_rep * n, d_k)
        scores = torch.matmul(grouped, keys.permute(0, 2, 3, 1))  # [B, Hkv, rep * n, m]
        scores = scores.view(n_batch, n_head_kv, n_rep, n, -1).mul_(scale).add_(bias[:, None, None])
        probs = torch.softmax(scores, dim=-1).view(n_batch, n_head_kv, n_rep * n, -1)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, Hkv, rep * n, d_v]
    return out.view(n_batch, n_head_kv, n_rep, n, -1).permute(0, 3, 1, 2, 4).reshape(n_batch, n, n_head, -1)


# keys read at most for grouped_attention's products to run on one thread: a few sequences' decode over
# short contexts (one token over 20 cells, 4 KV heads of 64: 5,120) hands its small products to the other
# thread for nothing (on a loaded machine the other thread first waits for a core)
ONE_THREAD_KV = 1 << 16


Gathered = tuple[torch.Tensor, torch.Tensor]  # flat K/V row of each token's visible cells, and validity
DecodeCells = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # store rows, then Gathered


def visible_rows(mask: torch.Tensor, stream_rows: torch.Tensor) -> Gathered:
    """Each token's visible cells of a mask ``[G, n, n_kv]`` as flat K/V rows ``[G * n, W]``
    (``stream_rows[g] + cell``, in cell order, padded with row 0) and their validity ``[G * n, W]``, ``W``
    the most any token sees (at least 1)."""
    n_groups, n, _ = mask.shape
    flat = mask.cpu().reshape(n_groups * n, -1)
    counts = flat.sum(-1)
    width = max(1, int(counts.max()) if counts.numel() else 1)
    row, j = flat.nonzero(as_tuple=True)  # row-major: each token's cells in cell order
    col = torch.arange(row.numel()) - (torch.cumsum(counts, 0) - counts)[row]
    index = torch.zeros(n_groups * n, width, dtype=torch.long)
    valid = torch.zeros(n_groups * n, width, dtype=torch.bool)
    index[row, col] = stream_rows[row // n] + j
    valid[row, col] = True
    return index, valid


def gathered_cells(mask: torch.Tensor, stream_rows: torch.Tensor) -> Gathered | None:
    """For a mask ``[G, n, n_kv]`` whose tokens each see few of the cells read (several sequences of one
    stream, one token each: a batched decode step over a unified cache), each token's visible cells as
    flat K/V rows ``[G * n, W]`` (``stream_rows[g] + cell``, padded) and their validity ``[G * n, W]``,
    ``W`` the most any token sees. None when the gathered rows would not be at most half of those read
    (attention over the stream as it is is then as cheap), or with one token a group."""
    _, n, n_kv = mask.shape
    if n < 2 or n_kv < 2:
        return None
    width = int(mask.sum(-1).max())
    if width == 0 or 2 * width > n_kv:
        return None
    return visible_rows(mask, stream_rows)


def attend_stored(
    cache: KVCache, il: int, seq_id: int, pos: list[int], q: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of one sequence's queries ``q`` ``[n, n_head, d_k]`` at positions ``pos`` over the keys and
    values the cache already holds for that sequence (positions up to each query's); nothing is written.
    A rollback replays tokens whose keys and values are still in the cache. Returns ``[n, n_head * d_v]``."""
    st = cache.stream_of(seq_id)
    cells = cache.streams[st]
    n_kv = cells.used_max_p1()
    mask = visible(cells, n_kv, [seq_id] * len(pos), pos, q.device)
    keys, values = cache.k_l[il][st, :n_kv].to(q.dtype), cache.v_l[il][st, :n_kv].to(q.dtype)
    n_head, d_k = q.shape[1], q.shape[2]
    d_k_all, d_v_all = keys.shape[-1], values.shape[-1]
    n_head_kv = d_k_all // d_k
    d_v = d_v_all // n_head_kv
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None],  # [1, H, n, d_k]
        keys.view(n_kv, n_head_kv, d_k).transpose(0, 1)[None],
        values.view(n_kv, n_head_kv, d_v).transpose(0, 1)[None],
        attn_mask=mask.to(q.device)[None, None],
        scale=scale,
        enable_gqa=n_head != n_head_kv,
    )  # [1, H, n, d_v]
    return out[0].transpose(0, 1).reshape(len(pos), n_head * d_v)
