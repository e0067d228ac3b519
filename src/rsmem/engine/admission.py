"""Admission: which waiting requests take sequences this step, and which wait for a shared prefix.

Requests without a slot go in arrival order (one that does not fit blocks the later ones, so a large
``n`` is not starved); a request pinned to a busy slot waits for it without blocking anyone, and the others
avoid the slots pinned requests wait for.

**Shared in-flight prefixes.** Requests that arrive together often share a long prefix nobody has cached
yet (a system prompt): each would prefill it. Instead, a request about to start whose prompt shares at
least ``MIN_SHARED`` more tokens than it could reuse now with a request being prefilled (its *leader*)
waits until the leader's checkpoint after the shared prefix is in the prefix cache, then restores it and
prefills only the rest. The shared prefix ends where the leader takes a checkpoint anyway (a message
boundary, the interval, its divergence from the cache), or, when the prompts share ``MIN_SHARED`` tokens
more than that, where the two prompts part (a checkpoint is added there to the leader's plan). A waiting
request holds no sequence and blocks nobody; its wait ends when the leader has prefilled the shared
prefix, ends or fails, becomes a suspect (``Lifecycle.fail_batch``), or after a bounded number of steps
(:func:`wait_bound`), and it then proceeds with whatever the cache holds (its own prefill otherwise).
A request waits at most once. Sessions continue their own state and never wait.

**Stranded requests.** When requests wait and nothing runs, a request that can never start (sessions
opened after it was queued hold its slot, or leave fewer sequences than its ``n``) fails instead of
waiting forever.
"""

from __future__ import annotations

from rsmem.engine.checkpoints import CheckpointCache
from rsmem.engine.lifecycle import Lifecycle
from rsmem.engine.pool import SequencePool
from rsmem.engine.prefix_cache import common_prefix
from rsmem.engine.request import ErrorKind, Follow, Phase, Request
from rsmem.engine.reuse import PromptReuse
from rsmem.engine.scheduler import RequestQueues
from rsmem.engine.status import EngineStats

MIN_SHARED = 32  # prompt tokens a request must save to wait for a leader


def wait_bound(n_tokens: int) -> int:
    """The most steps a request waits for a leader with ``n_tokens`` still to prefill up to the shared
    point: room for chunks of 16 tokens, plus a few steps (a leader gets at least 32 a step)."""
    return 4 + -(-n_tokens // 16)


class Admission:
    """Moves requests from the waiting queue to the running one (``queues``, the scheduler's)."""

    def __init__(
        self,
        pool: SequencePool,
        reuse: PromptReuse,
        checkpoints: CheckpointCache | None,
        stats: EngineStats,
        queues: RequestQueues,
        lifecycle: Lifecycle,
    ) -> None:
        self.pool = pool
        self.reuse = reuse
        self.checkpoints = checkpoints
        self.stats = stats
        self.queues = queues
        self.lifecycle = lifecycle

    def admit(self) -> None:
        """Give waiting requests their sequences; with nothing running, fail the stranded ones (see the
        module docstring)."""
        self._admit_waiting()
        if self.queues.n_waiting and not self.queues.n_running:
            self._refuse_stranded()

    def _admit_waiting(self) -> None:
        pool = self.pool
        wanted = {r.slot for r in self.queues.waiting if r.slot is not None}
        blocked = False
        for req in list(self.queues.waiting):
            if req.follow is not None and self._still_waits(req):
                continue
            if req.session is not None:
                first = req.session.seq_id
            elif req.slot is not None:
                if not pool.is_free(req.slot) or pool.n_free < req.params.n:
                    continue
                first = req.slot
            elif not blocked and pool.n_free >= req.params.n:
                first = pool.best_free(req.prompt_tokens, avoid=wanted)
            else:
                blocked = True
                continue
            if req.session is None and self._starts_waiting(req):
                continue
            if req.session is None:
                wanted.discard(req.slot)
                self.reuse.start(req, first)
            req.completions[0].seq_id = first
            for c in req.completions[1:]:
                c.seq_id = pool.best_free([], avoid=wanted)
                pool.take(c.seq_id, [])
            req.phase = Phase.PREFILL
            self.queues.admit(req)

    def _refuse_stranded(self) -> None:
        held = self.pool.held
        room = self.pool.n_seq - len(held)
        for req in list(self.queues.waiting):
            if req.session is not None:
                continue
            if req.params.n > room or req.slot in held:
                need = f"slot {req.slot}" if req.slot in held else f"{req.params.n} sequences"
                message = (
                    f"the request needs {need}, but sessions hold {len(held)} of the {self.pool.n_seq} "
                    "sequences"
                )
                self.lifecycle.fail(req, ErrorKind.REQUEST, message)

    def _still_waits(self, req: Request) -> bool:
        """Whether ``req``'s wait for its leader goes on this step (one step of its bound spent)."""
        follow = req.follow
        assert follow is not None
        lead = follow.leader
        if lead.finished or lead.suspect or lead.n_prefilled >= follow.n_tokens or follow.steps_left <= 0:
            req.follow = None
            return False
        follow.steps_left -= 1
        return True

    def _starts_waiting(self, req: Request) -> bool:
        """Whether ``req``, about to start, waits for a leader instead (at most once a request)."""
        if self.checkpoints is None or req.followed:
            return False
        found = self._leader(req)
        if found is None:
            return False
        lead, n = found
        if n not in lead.checkpoint_at:
            lead.checkpoint_at = sorted([*lead.checkpoint_at, n])
        req.follow = Follow(lead, n, wait_bound(n - lead.n_prefilled))
        req.followed = True
        self.stats.shared_prefix_waits += 1
        return True

    def _leader(self, req: Request) -> tuple[Request, int] | None:
        """The request being prefilled whose checkpoint would save ``req`` the most tokens, and the
        shared prefix's length; None when none saves ``MIN_SHARED``."""
        assert self.checkpoints is not None
        prompt = req.prompt_tokens
        reusable: int | None = None  # what req could start from now (computed when needed)
        best: tuple[Request, int] | None = None
        for lead in self.queues.running:
            # a session's prompt continues its state: its prefix is not the prompt's tokens alone
            if lead.phase is not Phase.PREFILL or lead.session is not None or lead.suspect:
                continue
            if lead.completions[0].replay:
                continue
            shared = min(common_prefix(lead.prompt_tokens, prompt), len(prompt) - 1)
            if shared - lead.n_prefilled < MIN_SHARED or (best is not None and shared <= best[1]):
                continue
            planned = [p for p in lead.checkpoint_at if lead.n_prefilled < p <= shared]
            point = max(planned, default=0)
            if shared - point >= MIN_SHARED and shared < len(lead.prompt_tokens):
                point = shared  # the leader checkpoints where the prompts part
            if reusable is None:
                reusable = self._reusable(prompt)
            if point - max(reusable, lead.n_prefilled) >= MIN_SHARED:
                best = (lead, point)
        return best

    def _reusable(self, prompt: list[int]) -> int:
        """The prompt tokens a request could reuse if it started now (a free sequence's kept state or a
        cached checkpoint)."""
        assert self.checkpoints is not None
        kept = max((self.pool.covered(s, prompt)[0] for s in self.pool.free), default=0)
        return max(kept, self.checkpoints.covered(prompt))
