"""The hybrid memory: llama.cpp's ``llama_memory_hybrid`` for Python.

Attention layers keep their K/V rows in a :class:`~rsmem.memory.kv_cache.KVCache`, the other layers their
recurrent state in a :class:`~rsmem.memory.recurrent.RecurrentMemory` (whose layer filter leaves the
attention layers out); one object offers the memory interface the Context uses, and its memory context
gives a model both ``read_states`` / ``write_states`` and ``attention``.

Sequence operations go to both parts with llama.cpp's combined results: ``seq_rm`` asks the recurrent part
first and touches the KV cache only if it agreed (a partial removal succeeds only where both can honour
it); ``seq_pos_min`` is the larger and ``seq_pos_max`` the smaller of the two parts' answers. Every check
that can fail runs before either part changes. A sequence's state bytes are the KV part
(:mod:`rsmem.memory.kv_state`), then the recurrent payload (:mod:`rsmem.memory.state_io`), as
``llama_memory_hybrid::state_write`` writes them; :meth:`HybridMemory.state_read` parses and checks both
parts, then installs them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, cast

import torch

from rsmem.batch.allocator import BatchAllocator
from rsmem.batch.batch import UBatch
from rsmem.errors import NoSlotError
from rsmem.memory import state_io
from rsmem.memory.context import MemoryStatus, RecurrentMemoryContext
from rsmem.memory.hybrid_state import parse_recurrent
from rsmem.memory.kv_attention import DecodeCells, KVCacheContext, attend_stored
from rsmem.memory.kv_cache import KVCache
from rsmem.memory.kv_state import KVStream, can_restore_kv, parse_kv, restore_kv, write_kv
from rsmem.memory.recurrent import RecurrentMemory, StateShape
from rsmem.memory.rollback import ReplayForward, RollbackHistory, ScratchState
from rsmem.memory.state_io import Payload, Reader


class HybridLayout(Protocol):
    """What a hybrid model declares so that its memory can be built."""

    @property
    def n_layer(self) -> int: ...

    @property
    def n_embd_r(self) -> int: ...

    @property
    def n_embd_s(self) -> int: ...

    @property
    def kv_layers(self) -> Mapping[int, tuple[int, int]]:
        """Attention layer -> ``(n_embd_k_gqa, n_embd_v_gqa)``."""
        ...

    def is_recurrent_layer(self, il: int) -> bool: ...

    def k_shift(self, il: int, rows: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
        """Layer ``il``'s stored keys ``rows`` moved by ``delta`` positions (RoPE re-rotation)."""
        ...


@dataclass(slots=True)
class HybridState:
    """A parsed, checked hybrid state: the KV part's streams and the recurrent payload."""

    kv: list[KVStream]
    recurrent: Payload


def kv_size_for(n_ctx: int, n_seq_max: int, unified: bool) -> int:
    """Cells of one KV stream, as llama.cpp sizes them: ``n_ctx`` when unified, else ``n_ctx / n_seq_max``
    rounded up to a multiple of 256."""
    if unified:
        return n_ctx
    per_seq = max(1, n_ctx // max(1, n_seq_max))
    return (per_seq + 255) // 256 * 256


class ReplayStates:
    """What a rollback's replay gives a hybrid model: the recurrent scratch rows, and attention that reads
    the keys and values the KV cache still holds for the replayed positions (it writes nothing)."""

    def __init__(self, scratch: ScratchState, kv: KVCache, ubatch: UBatch) -> None:
        self._scratch = scratch
        self._kv = kv
        self._seq = ubatch.seq_set(0)[0]
        self._pos = list(ubatch.pos)

    def read_states(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._scratch.read_states(il)

    def write_states(self, il: int, r_out: torch.Tensor, s_out: torch.Tensor) -> None:
        self._scratch.write_states(il, r_out, s_out)

    def attention(
        self,
        il: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        ubatch: UBatch | None = None,
    ) -> torch.Tensor:
        del k, v, ubatch  # the cache holds them already, computed from the same tokens
        return attend_stored(self._kv, il, self._seq, self._pos, q, scale)

    def decode_cells(self, ubatch: UBatch | None = None) -> DecodeCells | None:
        return None  # a replay writes no keys: the Python attention reads them

    def layer_rows(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise RuntimeError("a rollback's replay has no KV rows to write")


class HybridRollback(RollbackHistory):
    """The recurrent part's rollback history, whose replays also see the KV cache (:class:`ReplayStates`).

    A hybrid ``seq_rm`` cuts the recurrent state first, while the KV cache still holds every position."""

    def __init__(self, memory: RecurrentMemory, n_rs_seq: int, kv: KVCache) -> None:
        super().__init__(memory, n_rs_seq)
        self._kv = kv

    def bind(self, forward: ReplayForward, max_tokens: int) -> None:
        kv = self._kv

        def replay(ubatch: UBatch, scratch: ScratchState) -> object:
            # a model's forward takes any object with the memory context's methods; ReplayStates has them
            return forward(ubatch, cast(ScratchState, ReplayStates(scratch, kv, ubatch)))

        super().bind(replay, max_tokens)


class HybridMemory:
    """A KV cache and a recurrent memory under one set of sequence operations."""

    def __init__(self, recurrent: RecurrentMemory, kv: KVCache) -> None:
        """With a rollback window (``recurrent.n_rs_seq``) the recurrent part's history is replaced by a
        :class:`HybridRollback` over the same memory."""
        if recurrent.n_seq_max != kv.n_seq_max:
            raise ValueError(f"parts disagree on n_seq_max: {recurrent.n_seq_max} and {kv.n_seq_max}")
        self.recurrent = recurrent
        self.kv = kv
        self.n_seq_max = recurrent.n_seq_max
        if recurrent.rollback is not None:
            recurrent.rollback = HybridRollback(recurrent, recurrent.n_rs_seq, kv)
        self.rollback = recurrent.rollback

    @property
    def n_rs_seq(self) -> int:
        """How many trailing positions ``seq_rm`` may cut (the recurrent part's rollback window)."""
        return self.recurrent.n_rs_seq

    @classmethod
    def for_model(
        cls,
        model: HybridLayout,
        n_seq_max: int = 1,
        *,
        n_ctx: int = 4096,
        kv_unified: bool = False,
        state_dtype: torch.dtype = torch.float32,
        kv_dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        n_rs_seq: int = 0,
    ) -> HybridMemory:
        """The memory of a hybrid model: ``n_ctx`` KV cells in all (see :func:`kv_size_for`); ``n_rs_seq``:
        the rollback window (a bound model replays the recurrent part; see :class:`HybridRollback`)."""
        recurrent = RecurrentMemory(
            StateShape(model.n_layer, model.n_embd_r, model.n_embd_s),
            n_seq_max,
            dtype=state_dtype,
            device=device,
            layer_filter=model.is_recurrent_layer,
            n_rs_seq=n_rs_seq,
        )
        kv_size = kv_size_for(n_ctx, recurrent.n_seq_max, kv_unified)
        cell_ext = bool(getattr(model, "kv_cell_ext", False))  # M-RoPE models: cells keep their tokens
        kv = KVCache(
            model.kv_layers,
            kv_size,
            n_seq_max,
            unified=kv_unified,
            dtype=kv_dtype,
            device=device,
            cell_ext=cell_ext,
        )
        kv.set_k_shift(model.k_shift)
        return cls(recurrent, kv)

    # ------------------------------------------------------- sequence queries

    def require_seq(self, seq_id: int, what: str) -> None:
        self.recurrent.require_seq(seq_id, what)

    def seq_pos_min(self, seq_id: int) -> int:
        return max(self.kv.seq_pos_min(seq_id), self.recurrent.seq_pos_min(seq_id))

    def seq_pos_max(self, seq_id: int) -> int:
        return min(self.kv.seq_pos_max(seq_id), self.recurrent.seq_pos_max(seq_id))

    def seq_ids(self) -> list[int]:
        return [s for s in range(self.n_seq_max) if self.seq_pos_max(s) >= 0]

    def total_size(self) -> int:
        return self.kv.total_size() + self.recurrent.total_size()

    def state_bytes_per_seq(self) -> int:
        """Bytes of one sequence's recurrent state (all recurrent layers)."""
        return self.recurrent.state_bytes_per_seq()

    def kv_bytes_per_token(self) -> int:
        """K and V bytes one token takes in the cache (all attention layers)."""
        return self.kv.bytes_per_token()

    @property
    def size(self) -> int:
        """Sequence-state cells in all (the recurrent part's; the KV cache counts its own)."""
        return self.recurrent.size

    @property
    def used(self) -> int:
        """Sequence-state cells holding a state."""
        return self.recurrent.used

    @property
    def kv_cells_per_seq(self) -> int:
        """The most positions one sequence can hold in the KV cache: a stream's cells (per-sequence
        streams), or every cell (unified, shared with the other sequences)."""
        return self.kv.size

    def capture_memory(self) -> None:
        """No captures inside a micro-batch: a checkpoint carries a KV prefix (end the chunk, then take)."""
        return None

    # ---------------------------------------------------- sequence operations

    def clear(self, data: bool = True) -> None:
        self.kv.clear(data)
        self.recurrent.clear(data)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        """The recurrent part first: if it refuses (a cut it cannot honour), nothing changes and False."""
        if not self.recurrent.seq_rm(seq_id, p0, p1):
            return False
        return self.kv.seq_rm(seq_id, p0, p1)

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None:
        self.require_seq(seq_id_src, "seq_cp source")
        self.require_seq(seq_id_dst, "seq_cp destination")
        self.kv.seq_cp(seq_id_src, seq_id_dst, p0, p1)  # may refuse a partial cross-stream copy first
        self.recurrent.seq_cp(seq_id_src, seq_id_dst, p0, p1)

    def seq_keep(self, seq_id: int) -> None:
        self.require_seq(seq_id, "seq_keep")
        self.kv.seq_keep(seq_id)
        self.recurrent.seq_keep(seq_id)

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None:
        """The recurrent part first: it refuses a move below position 0 before anything changes."""
        self.recurrent.seq_add(seq_id, p0, p1, shift)
        self.kv.seq_add(seq_id, p0, p1, shift)

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None:
        self.recurrent.seq_div(seq_id, p0, p1, d)
        self.kv.seq_div(seq_id, p0, p1, d)

    # ------------------------------------------------------ batch processing

    def init_batch(
        self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False
    ) -> HybridMemoryContext:
        """Split as the recurrent part needs (equal tokens per sequence), then dry-run both placements."""
        balloc.split_reset()
        ubatches: list[UBatch] = []
        rollback = self.recurrent.rollback
        tail, before = (0, 1) if rollback is None else (rollback.n_rs_seq, rollback.spacing)
        while True:
            ub = balloc.split_seq(n_ubatch) if embd_all else balloc.split_equal(n_ubatch, False, tail, before)
            if ub is None:
                break
            ubatches.append(ub)
        failed = HybridMemoryContext(self, [], None, None, MemoryStatus.FAILED_PREPARE)
        if balloc.n_used < balloc.n_tokens or not self.recurrent.prepare(ubatches):
            return failed
        sinfos = self.kv.prepare(ubatches)
        if sinfos is None:
            return failed
        return HybridMemoryContext(
            self,
            ubatches,
            RecurrentMemoryContext(self.recurrent, ubatches, MemoryStatus.SUCCESS),
            KVCacheContext(self.kv, ubatches, sinfos, MemoryStatus.SUCCESS),
            MemoryStatus.SUCCESS,
        )

    # ------------------------------------------------------------ state bytes

    def state_write(self, seq_id: int = -1) -> bytes:
        """The KV part, then the recurrent payload: one sequence's state, or (``-1``) every sequence's."""
        if seq_id >= 0:
            self.require_seq(seq_id, "state write")
        return write_kv(self.kv, seq_id) + state_io.write_payload(self.recurrent, seq_id)

    def parse_state(self, reader: Reader, dest_seq: int = -1) -> HybridState:
        """Decode and check bytes written by :meth:`state_write` for ``dest_seq`` (``-1``: the whole memory)
        and dry-run their placement; changes nothing. Raises StateFormatError or NoSlotError."""
        if dest_seq >= 0:
            self.require_seq(dest_seq, "state restore")
        kv_streams = parse_kv(reader, self.kv, dest_seq)
        payload = parse_recurrent(reader, self.recurrent, dest_seq)
        if dest_seq >= 0:
            fits_kv = can_restore_kv(self.kv, kv_streams, dest_seq)
            if not fits_kv or (payload.cells and not state_io.can_install(self.recurrent, dest_seq)):
                raise NoSlotError(f"no free cells to restore sequence {dest_seq}")
        return HybridState(kv_streams, payload)

    def install_state(self, state: HybridState, dest_seq: int = -1) -> None:
        """Install what :meth:`parse_state` returned (for the same ``dest_seq``, nothing changed since)."""
        restore_kv(self.kv, state.kv, dest_seq)
        state_io.restore_payload(self.recurrent, state.recurrent, dest_seq)

    def state_read(self, reader: Reader, dest_seq: int = -1) -> None:
        """:meth:`parse_state`, which must end ``reader``'s data, then :meth:`install_state`: a failure
        leaves the memory as it was."""
        state = self.parse_state(reader, dest_seq)
        reader.expect_end()
        self.install_state(state, dest_seq)

    def check_invariants(self) -> None:
        self.kv.check_invariants()
        self.recurrent.check_invariants()


class HybridMemoryContext:
    """The plan for one batch over both parts: what ``Context.decode`` drives and a model reads."""

    def __init__(
        self,
        memory: HybridMemory,
        ubatches: list[UBatch],
        recurrent: RecurrentMemoryContext | None,
        kv: KVCacheContext | None,
        status: MemoryStatus,
    ) -> None:
        self.memory = memory
        self.ubatches = ubatches
        self.status = status
        self._recurrent = recurrent
        self._kv = kv
        self._i = 0

    def _parts(self) -> tuple[RecurrentMemoryContext, KVCacheContext]:
        if self._recurrent is None or self._kv is None:
            raise RuntimeError(f"a hybrid memory context with status {self.status.name} has no plan")
        return self._recurrent, self._kv

    @property
    def ubatch(self) -> UBatch:
        return self.ubatches[self._i]

    def apply(self) -> bool:
        recurrent, kv = self._parts()
        kv.apply()
        recurrent.apply()
        return True

    def next(self) -> bool:
        recurrent, kv = self._parts()
        kv.next()
        recurrent.next()
        self._i += 1
        return self._i < len(self.ubatches)

    def read_states(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._parts()[0].read_states(il)

    def write_states(self, il: int, r_out: torch.Tensor, s_out: torch.Tensor) -> None:
        self._parts()[0].write_states(il, r_out, s_out)

    def attention(
        self,
        il: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        ubatch: UBatch | None = None,
    ) -> torch.Tensor:
        """See :meth:`~rsmem.memory.kv_attention.KVCacheContext.attention`."""
        return self._parts()[1].attention(il, q, k, v, scale, ubatch)

    def decode_cells(self, ubatch: UBatch | None = None) -> DecodeCells | None:
        """See :meth:`~rsmem.memory.kv_attention.KVCacheContext.decode_cells`."""
        return self._parts()[1].decode_cells(ubatch)

    def layer_rows(self, il: int) -> tuple[torch.Tensor, torch.Tensor]:
        """See :meth:`~rsmem.memory.kv_attention.KVCacheContext.layer_rows`."""
        return self._parts()[1].layer_rows(il)
