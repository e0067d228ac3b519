"""``SequenceMemory``: what the Context, the engine and the server use of a memory.

Two memories offer it: :class:`~rsmem.memory.recurrent.RecurrentMemory` (pure recurrent models) and
:class:`~rsmem.memory.hybrid.HybridMemory` (a KV cache beside it). Sequence operations and their results
are llama.cpp's ``llama_memory_*``; ``init_batch`` returns a :class:`MemoryBatch`, the plan a decode
drives (``apply`` -> model forward -> ``next``) and the state access a model forward receives.

"Cells" (``used``, ``size``) count sequence states: one per sequence holding one (shared after
``seq_cp``), at most ``n_seq_max``; a hybrid's KV cells are its KV cache's business.
State bytes are ``llama_memory_i``'s: each memory writes and reads its own (``state_write`` /
``state_read``), and :mod:`rsmem.memory.state_io` frames them the same way for every memory (blobs,
'ggsq' and 'ggsn' files).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

from rsmem.batch.allocator import BatchAllocator
from rsmem.batch.batch import UBatch
from rsmem.memory.context import MemoryStatus
from rsmem.memory.rollback import RollbackHistory

if TYPE_CHECKING:
    from rsmem.memory.recurrent import RecurrentMemory
    from rsmem.memory.state_io import Reader


class MemoryBatch(Protocol):
    """The plan of one batch: its micro-batches placed one at a time, and their states for the model."""

    @property
    def status(self) -> MemoryStatus: ...

    @property
    def ubatch(self) -> UBatch:
        """The current micro-batch."""
        ...

    def apply(self) -> bool:
        """Place the current micro-batch (its dry run already succeeded)."""
        ...

    def next(self) -> bool:
        """The current micro-batch was computed; move on (False when none is left)."""
        ...

    def read_states(self, il: int) -> tuple[torch.Tensor, torch.Tensor]: ...

    def write_states(self, il: int, r_out: torch.Tensor, s_out: torch.Tensor) -> None: ...


class SequenceMemory(Protocol):
    """A memory of ``n_seq_max`` sequences with llama.cpp's sequence operations."""

    @property
    def n_seq_max(self) -> int: ...

    @property
    def size(self) -> int:
        """Sequence-state cells in all."""
        ...

    @property
    def used(self) -> int:
        """Sequence-state cells holding a state."""
        ...

    @property
    def n_rs_seq(self) -> int:
        """How many trailing positions ``seq_rm`` may cut (0: none)."""
        ...

    @property
    def rollback(self) -> RollbackHistory | None:
        """The rollback history a Context binds its model to (None without ``n_rs_seq``)."""
        ...

    def require_seq(self, seq_id: int, what: str) -> None:
        """Raise UnknownSequenceError naming ``what`` unless ``0 <= seq_id < n_seq_max``."""
        ...

    def seq_pos_min(self, seq_id: int) -> int: ...

    def seq_pos_max(self, seq_id: int) -> int: ...

    def seq_ids(self) -> list[int]: ...

    def clear(self, data: bool = True) -> None: ...

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool: ...

    def seq_cp(self, seq_id_src: int, seq_id_dst: int, p0: int = -1, p1: int = -1) -> None: ...

    def seq_keep(self, seq_id: int) -> None: ...

    def seq_add(self, seq_id: int, p0: int, p1: int, shift: int) -> None: ...

    def seq_div(self, seq_id: int, p0: int, p1: int, d: int) -> None: ...

    def init_batch(self, balloc: BatchAllocator, n_ubatch: int, embd_all: bool = False) -> MemoryBatch:
        """Split the allocator's batch and dry-run its placement; the memory is unchanged."""
        ...

    def state_bytes_per_seq(self) -> int:
        """Bytes of one sequence's recurrent state."""
        ...

    def total_size(self) -> int:
        """Bytes the memory holds for states (and K/V)."""
        ...

    @property
    def kv_cells_per_seq(self) -> int | None:
        """The most positions one sequence can hold in a KV cache (shared with the other sequences when
        unified); None when nothing bounds it (no KV cache)."""
        ...

    def capture_memory(self) -> RecurrentMemory | None:
        """The recurrent memory whose cells a capture inside a micro-batch reads
        (:mod:`rsmem.memory.capture`); None where captures are not offered."""
        ...

    def state_write(self, seq_id: int = -1) -> bytes:
        """One sequence's state bytes (``seq_id >= 0``) or every sequence's (``-1``), as llama.cpp's
        ``llama_memory_i::state_write`` lays them out."""
        ...

    def state_read(self, reader: Reader, dest_seq: int = -1) -> None:
        """Read bytes :meth:`state_write` wrote, which must end ``reader``'s data, into ``dest_seq`` (``-1``:
        the whole memory). Everything is checked before anything changes: StateFormatError or NoSlotError
        leaves the memory as it was."""
        ...

    def check_invariants(self) -> None: ...
