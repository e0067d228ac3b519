"""Saving and restoring the KV cache's state, byte-compatible with ``llama_kv_cache::state_write``.

Layout (little-endian)::

    u32 n_stream                                   (the cache's: one sequence's state lists every stream)
    per stream: u32 cell_count; when > 0:
        per cell: i32 pos, u32 n_seq_id, n_seq_id x i32 seq_id      (one sequence's state: just that id)
                  (a cache with ``cell_ext``: i32 x, i32 y, i32 tok after n_seq_id; x = y = pos for text)
        u32 v_trans, u32 n_layer (attention layers)
        per layer: i32 ggml_type, u64 row_bytes, cell_count K rows
        v_trans = 0: per layer: i32 ggml_type, u64 row_bytes, cell_count V rows
        v_trans = 1: per layer: i32 ggml_type, u32 element_bytes, u32 n_embd_v_gqa, then per channel the
                     values of every cell (V transposed)

Cells are written in cell order. Reading is two-phase as in :mod:`rsmem.memory.state_io`: :func:`parse_kv`
checks every field and decodes the rows (finite, in the cache's dtype) without touching the cache;
:func:`can_restore_kv` dry-runs the placement; :func:`restore_kv` installs it. Unlike llama.cpp, a state
with either V layout loads (it is transposed as needed), F32/F16/BF16 rows load into a cache of any of
those dtypes, and one sequence's state loads into a cache of any stream count (:func:`parse_kv`).
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import torch

from rsmem.batch.batch import UBatch
from rsmem.errors import NoSlotError, StateFormatError
from rsmem.memory.kv_cache import KVCache
from rsmem.memory.kv_cells import KVCells, SlotInfo
from rsmem.memory.state_io import DTYPE_OF_GGML_TYPE, GGML_TYPE_NAMES, GGML_TYPE_OF_DTYPE, Reader

MAX_STREAMS = 256  # llama.cpp's LLAMA_MAX_SEQ: a cache has at most one stream a sequence


@dataclass(slots=True)
class KVStream:
    """One stream's decoded cells and rows (``k[il]`` ``[n, n_embd_k]``, ``v[il]`` ``[n, n_embd_v]``)."""

    stream: int
    cells: list[tuple[int, tuple[int, ...]]]
    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]
    tok: list[int] | None = None  # the cells' tokens (ext.tok) of a cache with cell_ext


# ---------------------------------------------------------------- writing


def _bytes(t: torch.Tensor) -> bytes:
    """Row-major bytes of ``t``. Flattened first: a ``[n, 1]`` transposed view counts as contiguous with a
    last stride of ``n``, which a byte view refuses."""
    return t.reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()


def write_kv(cache: KVCache, seq_id: int = -1) -> bytes:
    """The KV part of one sequence's state (``seq_id >= 0``) or of every cell (``-1``). Pending position
    shifts are applied to the keys first."""
    cache.update()
    out = [struct.pack("<I", cache.n_stream)]
    for st, cells in enumerate(cache.streams):
        idx = [i for i in range(cells.size) if cells.pos[i] >= 0 and (seq_id < 0 or seq_id in cells.seqs[i])]
        out.append(struct.pack("<I", len(idx)))
        if not idx:
            continue
        for i in idx:
            ids = sorted(cells.seqs[i]) if seq_id < 0 else [seq_id]
            if cache.cell_ext:
                ext = (cells.pos[i], cells.pos[i], cache.cell_tok[st][i])
                out.append(struct.pack(f"<iI3i{len(ids)}i", cells.pos[i], len(ids), *ext, *ids))
                continue
            out.append(struct.pack(f"<iI{len(ids)}i", cells.pos[i], len(ids), *ids))
        out.append(struct.pack("<II", int(cache.v_trans), len(cache.layer_dims)))
        index = torch.tensor(idx, dtype=torch.long, device=cache.device)
        for k in cache.k_l.values():
            out.append(struct.pack("<iQ", GGML_TYPE_OF_DTYPE[k.dtype], k.shape[-1] * k.element_size()))
            out.append(_bytes(k[st].index_select(0, index)))
        for v in cache.v_l.values():
            rows = v[st].index_select(0, index)
            if cache.v_trans:
                out.append(struct.pack("<iII", GGML_TYPE_OF_DTYPE[v.dtype], v.element_size(), v.shape[-1]))
                out.append(_bytes(rows.t()))
            else:
                out.append(struct.pack("<iQ", GGML_TYPE_OF_DTYPE[v.dtype], v.shape[-1] * v.element_size()))
                out.append(_bytes(rows))
    return b"".join(out)


# ---------------------------------------------------------------- reading


def _dtype(type_id: int, what: str) -> torch.dtype:
    dtype = DTYPE_OF_GGML_TYPE.get(type_id)
    if dtype is None:
        name = GGML_TYPE_NAMES.get(type_id, f"unknown type {type_id}")
        raise StateFormatError(f"{what} are {name}; only F32, F16 and BF16 states load")
    return dtype


def _decode(
    raw: memoryview, dtype: torch.dtype, shape: tuple[int, int], into: torch.dtype, what: str
) -> torch.Tensor:
    if shape[0] * shape[1] == 0:
        return torch.empty(shape, dtype=into)
    rows = torch.frombuffer(bytearray(raw), dtype=dtype).view(shape).to(into)
    if not bool(torch.isfinite(rows).all()):
        raise StateFormatError(f"{what} hold non-finite values (NaN or inf)")
    return rows


def _parse_rows(reader: Reader, cache: KVCache, il: int, n: int, kind: str, v_trans: bool) -> torch.Tensor:
    width = cache.layer_dims[il][0 if kind == "K" else 1]
    what = f"layer {il}: {kind} rows"
    dtype = _dtype(reader.i32(f"{kind} type of layer {il}"), what)
    size = torch.finfo(dtype).bits // 8
    if v_trans:
        el = reader.u32(f"V element size of layer {il}")
        n_embd = reader.u32(f"V width of layer {il}")
        if el != size or n_embd != width:
            raise StateFormatError(f"{what}: {n_embd} x {el}-byte values, this model needs {width} x {size}")
        raw = reader.take(n * width * size, what)
        return _decode(raw, dtype, (width, n), cache.dtype, what).t().contiguous()
    row_bytes = reader.unpack("Q", f"{kind} row size of layer {il}")[0]
    if row_bytes != width * size:
        raise StateFormatError(f"{what}: rows of {row_bytes} bytes, this model needs {width * size}")
    return _decode(reader.take(n * row_bytes, what), dtype, (n, width), cache.dtype, what)


def _streams(n: int) -> str:
    """How a cache of ``n`` streams was made."""
    if n == 1:
        return "1 stream (kv_unified, or one sequence)"
    return f"{n} streams (one for each of {n} sequences, not kv_unified)"


def _fix(n: int) -> str:
    """The settings that make a cache of ``n`` streams."""
    if n == 1:
        return "load it with kv_unified / --kv-unified, or n_seq_max / -np 1"
    return f"load it with n_seq_max / -np {n}, without kv_unified / --kv-unified"


def parse_kv(reader: Reader, cache: KVCache, dest_seq: int) -> list[KVStream]:
    """Decode and check the KV part against ``cache``: one sequence's (``dest_seq >= 0``) or the whole
    cache's. Raises StateFormatError; changes nothing.

    A sequence's state has the cells of one stream (llama.cpp writes every stream of its cache, the others
    empty): they go to ``dest_seq``'s stream whatever the two caches' stream counts, so a sequence file
    moves between contexts of any ``n_seq_max`` and ``kv_unified``, where llama.cpp requires the same
    stream count. A whole cache's state needs as many streams as it was saved with."""
    n_stream = reader.u32("KV stream count")
    if dest_seq < 0 and n_stream != cache.n_stream:
        raise StateFormatError(
            f"the state's KV cache has {_streams(n_stream)}, this one {_streams(cache.n_stream)}: a whole "
            f"context's state loads only into as many streams ({_fix(n_stream)})"
        )
    if not 1 <= n_stream <= MAX_STREAMS:
        raise StateFormatError(f"KV stream count {n_stream} is outside [1, {MAX_STREAMS}]")
    streams = []
    for st in range(n_stream):
        n = reader.u32(f"KV stream {st} cell count")
        if n == 0:
            continue
        if n > cache.size:
            room = "a sequence here has" if dest_seq >= 0 else f"stream {st} here has"
            raise StateFormatError(
                f"the state holds {n} KV cells in stream {st}, {room} {cache.size} (a larger n_ctx / -c"
                f"{'' if cache.unified else ', or fewer sequences'} gives more)"
            )
        cells = []
        toks: list[int] = []
        for i in range(n):
            pos, n_ids = reader.unpack("iI", f"KV cell {i} header")
            if cache.cell_ext:
                toks.append(reader.unpack("3i", f"KV cell {i} ext")[2])
            if pos < 0:
                raise StateFormatError(f"KV cell {i}: position {pos} is negative")
            if dest_seq >= 0 and n_ids != 1:
                raise StateFormatError(f"KV cell {i}: a sequence's state lists {n_ids} seq ids, expected 1")
            if not 1 <= n_ids <= cache.n_seq_max:
                raise StateFormatError(f"KV cell {i}: {n_ids} seq ids, expected 1 to {cache.n_seq_max}")
            ids = reader.unpack(f"{n_ids}i", f"KV cell {i} seq ids")
            # a sequence's state goes to dest_seq whatever sequence it was saved from (as llama.cpp)
            for s in ids if dest_seq < 0 else ():
                if not 0 <= s < cache.n_seq_max or (not cache.unified and s != st):
                    raise StateFormatError(f"KV cell {i}: seq id {s} does not belong in stream {st}")
            cells.append((pos, (dest_seq,) if dest_seq >= 0 else tuple(ids)))
        v_trans, n_layer = reader.unpack("II", "KV layout header")
        if n_layer != len(cache.layer_dims):
            raise StateFormatError(
                f"KV state has {n_layer} attention layers, the model {len(cache.layer_dims)}"
            )
        k = {il: _parse_rows(reader, cache, il, n, "K", False) for il in cache.layer_dims}
        v = {il: _parse_rows(reader, cache, il, n, "V", bool(v_trans)) for il in cache.layer_dims}
        streams.append(KVStream(st, cells, k, v, toks if cache.cell_ext else None))
    if dest_seq >= 0 and len(streams) > 1:
        raise StateFormatError(f"a sequence's KV state has cells in {len(streams)} streams, expected one")
    return streams


def _place(cache: KVCache, stream: KVStream, dest_seq: int) -> tuple[int, SlotInfo | None]:
    """Release ``dest_seq``'s cells and find cells for the state (changes the cells: see callers)."""
    st = cache.stream_of(dest_seq)
    cache.seq_rm(dest_seq, -1, -1)
    n = len(stream.cells)
    ub = UBatch(
        tokens=tuple(stream.tok) if stream.tok is not None else (-1,) * n,
        pos=tuple(p for p, _ in stream.cells),
        seq_ids=((dest_seq,),) * n,
        outputs=(False,) * n,
        batch_index=tuple(range(n)),
        n_seqs=1,
        n_seq_tokens=n,
        equal_seqs=True,
    )
    sinfo = cache.find_slot(ub)
    if sinfo is not None:
        cache.apply_ubatch(sinfo, ub)
    return st, sinfo


def can_restore_kv(cache: KVCache, streams: list[KVStream], dest_seq: int) -> bool:
    """Whether :func:`restore_kv` would find cells (a dry run: the cells are put back)."""
    if dest_seq < 0 or not streams:
        return True
    st = cache.stream_of(dest_seq)
    saved: KVCells = cache.streams[st].copy()
    heads = list(cache.heads)
    toks = list(cache.cell_tok[st]) if cache.cell_ext else []
    try:
        return _place(cache, streams[0], dest_seq)[1] is not None
    finally:
        cache.streams[st], cache.heads = saved, heads
        if cache.cell_ext:
            cache.cell_tok[st] = toks


def restore_kv(cache: KVCache, streams: list[KVStream], dest_seq: int) -> None:
    """Install a parsed KV part as ``dest_seq``'s cells (the sequence's old cells are released), or as the
    whole cache when ``dest_seq < 0``. Raises NoSlotError, unchanged, when the cells do not fit."""
    if dest_seq < 0:
        cache.clear(data=True)
        for s in streams:
            cells = cache.streams[s.stream]
            for i, (pos, ids) in enumerate(s.cells):
                cells.occupy(i, pos, set(ids))
                if cache.cell_ext:
                    cache.cell_tok[s.stream][i] = s.tok[i] if s.tok is not None else -1
            _write_rows(cache, s, s.stream, list(range(len(s.cells))))
        return
    if not can_restore_kv(cache, streams, dest_seq):
        raise NoSlotError(f"no free KV cells to restore sequence {dest_seq}")
    if not streams:
        cache.seq_rm(dest_seq, -1, -1)
        return
    st, sinfo = _place(cache, streams[0], dest_seq)
    assert sinfo is not None
    _write_rows(cache, streams[0], st, sinfo.groups[0][1])


def _write_rows(cache: KVCache, stream: KVStream, st: int, idxs: list[int]) -> None:
    index = torch.tensor(idxs, dtype=torch.long, device=cache.device)
    for il in cache.layer_dims:
        cache.k_l[il][st].index_copy_(0, index, stream.k[il].to(cache.device))
        cache.v_l[il][st].index_copy_(0, index, stream.v[il].to(cache.device))
