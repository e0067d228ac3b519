"""One read of the engine's state for servers: slots, queue, totals, memory cells and cache figures."""

from __future__ import annotations

from rsmem.engine.checkpoints import CheckpointCache
from rsmem.engine.pool import SequencePool
from rsmem.engine.scheduler import RequestQueues
from rsmem.engine.status import EngineSnapshot, EngineStats, Health, SlotInfo
from rsmem.memory.protocol import SequenceMemory


def active_cells(memory: SequenceMemory, pool: SequencePool) -> int:
    """Cells held by running requests and sessions (the rest of ``memory.used`` is cache)."""
    return sum(1 for s in range(pool.n_seq) if not pool.is_free(s) and memory.seq_pos_max(s) >= 0)


def take_snapshot(
    memory: SequenceMemory,
    pool: SequencePool,
    queues: RequestQueues,
    stats: EngineStats,
    health: Health,
    checkpoints: CheckpointCache | None,
) -> EngineSnapshot:
    on_seq = {c.seq_id: r.request_id for r in queues.running for c in r.completions if c.seq_id >= 0}
    slots = tuple(
        SlotInfo(
            s,
            s in on_seq or pool.session_of(s) is not None,
            on_seq.get(s),
            len(pool.cached_tokens(s)),
            checkpoints.tree.along(pool.cached_tokens(s)) if checkpoints is not None else (),
        )
        for s in range(pool.n_seq)
    )
    state, reason = health.status()
    s = stats
    return EngineSnapshot(
        n_slots=pool.n_seq,
        waiting=queues.n_waiting,
        waiting_seqs=sum(r.params.n for r in queues.waiting),
        running=queues.n_running,
        free_slots=pool.n_free,
        slots=slots,
        prompt_tokens=s.prompt_tokens,
        cached_prompt_tokens=s.cached_prompt_tokens,
        generated_tokens=s.generated_tokens,
        decode_seconds=s.decode_seconds,
        steps=s.steps,
        requests_finished=s.requests_finished,
        requests_failed=s.requests_failed,
        cells_active=active_cells(memory, pool),
        cells_used=memory.used,
        cells_total=memory.size,
        health=state,
        health_reason=reason,
        **_cache_figures(stats, checkpoints),
    )


def _cache_figures(s: EngineStats, cache: CheckpointCache | None) -> dict[str, int]:
    hits = {
        "cache_hits_extension": s.cache_hits_extension,
        "cache_hits_rollback": s.cache_hits_rollback,
        "cache_hits_checkpoint": s.cache_hits_checkpoint,
        "cache_misses": s.cache_misses,
    }
    if cache is None:
        return hits
    disk = cache.disk
    if disk is not None:
        hits |= {
            "disk_entries": len(disk),
            "disk_bytes": disk.nbytes,
            "disk_restores": cache.stats.disk_restores,
            "disk_written": disk.stats.written,
            "disk_write_errors": disk.stats.write_errors,
            "disk_corrupt": disk.stats.corrupt,
            "disk_evictions": disk.stats.evictions,
        }
    return hits | {
        "checkpoints_added": cache.stats.added,
        "cache_entries": len(cache),
        "cache_bytes": cache.nbytes,
        "cache_evictions": cache.tree.stats.evictions,
        "checkpoints_taken": cache.stats.taken,
        "checkpoint_restores": cache.stats.restored,
        "checkpoint_tokens": cache.stats.restored_tokens,
    }
