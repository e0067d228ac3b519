"""How a prompt reuses what the engine kept: where it starts, and the checkpoints its prefill leaves.

A new prompt starts from the most it can reuse: its sequence's own kept state (extended, or rolled back
by the memory's ``n_rs_seq``) or the prefix cache's checkpoint of its longest cached prefix, restored
into its sequence. Its prefill then leaves checkpoints where :class:`CheckpointCache` wants them:
captured by the decode from inside the chunk that runs past them, or, for a memory that cannot capture
(a hybrid's), taken where the scheduler ended a chunk.

What was kept gives way to what runs. Where every sequence's KV rows share one set of cells (a hybrid
memory with ``kv_unified``), free sequences' cached states hold cells a request may need: before a
decode (:meth:`PromptReuse.make_room`) and before a checkpoint is restored, they are cleared, the one
cached longest ago first, until the new rows fit (:meth:`SequencePool.evict_until`). A checkpoint that
still finds no cells is not restored: its prompt is prefilled instead.
"""

from __future__ import annotations

from collections.abc import Mapping

from rsmem.engine.checkpoints import CheckpointCache
from rsmem.engine.pool import SequencePool
from rsmem.engine.request import Request
from rsmem.engine.scheduler import Planned
from rsmem.engine.status import EngineStats
from rsmem.memory import checkpoint
from rsmem.memory.checkpoint import Checkpoint
from rsmem.memory.hybrid import HybridMemory
from rsmem.memory.protocol import SequenceMemory
from rsmem.memory.recurrent import RecurrentMemory


class PromptReuse:
    def __init__(
        self,
        pool: SequencePool,
        checkpoints: CheckpointCache | None,
        stats: EngineStats,
        memory: SequenceMemory,
    ) -> None:
        self.pool = pool
        self.checkpoints = checkpoints
        self.stats = stats
        # checkpoints inside a prefill are captured from the chunk (a recurrent memory) or cut there
        self.captures = isinstance(memory, RecurrentMemory) and checkpoints is not None
        self._shared = memory if isinstance(memory, HybridMemory) and memory.kv.unified else None

    def start(self, req: Request, seq: int) -> None:
        """Continue ``req``'s prompt in ``seq`` from the most it can reuse; plan its checkpoints."""
        n, rolled_back = self.pool.take(seq, req.prompt_tokens)
        kind = ("rollback" if rolled_back else "extension") if n else "miss"
        if self.checkpoints is not None:
            restored = self.checkpoints.restore_best(
                req.prompt_tokens, seq, n, room=lambda ckpt: self._room_for(ckpt, seq)
            )
            if restored:
                n, kind = restored, "checkpoint"
            req.checkpoint_at = self.checkpoints.positions(req.prompt_tokens, n, req.boundaries)
        req.n_cached = req.n_prefilled = n
        self.stats.cached_prompt_tokens += n
        self.stats.count_cache_use(kind)

    @property
    def shares_cells(self) -> bool:
        """Whether every sequence's KV rows share one set of cells (cached states give way to others)."""
        return self._shared is not None

    def make_room(self, n_tokens: int) -> bool:
        """Before a decode of ``n_tokens`` new positions: in shared cells, clear cached states until
        that many cells are free; returns whether they are (always, where cells are not shared)."""
        memory = self._shared
        if memory is None:
            return True
        kv = memory.kv
        return self.pool.evict_until(lambda: kv.size - kv.streams[0].n_used >= n_tokens)

    def _room_for(self, ckpt: Checkpoint, seq: int) -> bool:
        """Whether ``ckpt`` fits ``seq``, after clearing cached states in shared cells (elsewhere the
        restore itself finds out)."""
        memory = self._shared
        if memory is None:
            return True
        return self.pool.evict_until(lambda: checkpoint.fits(memory, ckpt, seq))

    def capture_points(self, plan: list[Planned]) -> dict[int, list[int]] | None:
        """The checkpoints due inside the plan's prompt chunks, by sequence (token counts), for
        ``Context.decode(capture=...)``; None when there are none or the memory cannot capture."""
        if not self.captures:
            return None
        points: dict[int, list[int]] = {}
        for part in plan:
            req = part.req
            if part.completion is None and req.checkpoint_at:
                start, end = req.n_prefilled, req.n_prefilled + part.n_tokens
                due = [p for p in req.checkpoint_at if start < p <= end]
                if due:
                    points[req.prefill_seq] = due
        return points or None

    def keep(self, req: Request, start: int, captured: Mapping[tuple[int, int], Checkpoint]) -> None:
        """The chunk of ``req``'s prompt after ``start`` ran: keep the checkpoints due in it (captured
        inside it, or taken where the chunk was cut)."""
        if self.checkpoints is None:
            return
        for p in req.checkpoint_at:
            if not start < p <= req.n_prefilled:
                continue
            if self.captures:
                ckpt = captured.get((req.prefill_seq, p))
                if ckpt is not None:
                    self.checkpoints.put(req.prompt_tokens[:p], ckpt, "prompt")
            elif p == req.n_prefilled:
                self.checkpoints.take(req.prompt_tokens[:p], req.prefill_seq, "prompt")
