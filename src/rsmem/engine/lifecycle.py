"""How requests end: finishing a completion, failing a request, and freeing (and caching) sequences.

A finished completion returns its sequence to the pool; with the prompt cache its state stays there for
a prompt that extends it, and with the prefix cache a checkpoint of it is taken. A failed request caches
nothing (its state was lost or cannot be trusted) and empties the session it ran in. When the model
fails on a batch of several requests, they replay their states instead, and run alone until each
produces output, so only a request the model fails on by itself fails.
"""

from __future__ import annotations

from rsmem.engine.checkpoints import CheckpointCache
from rsmem.engine.pool import SequencePool
from rsmem.engine.request import Completion, ErrorKind, FinishReason, Phase, Request
from rsmem.engine.scheduler import Planned, RequestQueues, plan_replay
from rsmem.engine.status import EngineStats, Health
from rsmem.memory.protocol import SequenceMemory


class Lifecycle:
    """Ends requests for the engine; an ended request leaves ``queues`` (the scheduler's)."""

    def __init__(
        self,
        memory: SequenceMemory,
        pool: SequencePool,
        checkpoints: CheckpointCache | None,
        stats: EngineStats,
        health: Health,
        queues: RequestQueues,
    ) -> None:
        self.memory = memory
        self.pool = pool
        self.checkpoints = checkpoints
        self.stats = stats
        self.health = health
        self.queues = queues
        self.ended: list[Request] = []  # requests finished since the engine last took them (``take_ended``)

    def finish(self, req: Request, c: Completion, reason: FinishReason, *, flush: bool = True) -> None:
        """End one completion (EOS, a stop string, its length); its request ends with its last one."""
        if flush and c.detok is not None:
            c.text += c.detok.flush()
        c.finish_reason = reason
        self.free_completion(c, req)

    def fail(
        self,
        req: Request,
        kind: ErrorKind,
        message: str,
        *,
        state_lost: bool = True,
        reason: FinishReason | None = None,
    ) -> None:
        """Finish ``req`` with an error: its sequences are cleared and nothing of it is cached; a session
        it ran in is emptied (its state was lost or cannot be trusted)."""
        if req.finished:
            return
        req.error_kind = kind
        for c in req.completions:
            if not c.finished:
                c.finish_reason = reason or FinishReason.ERROR
                c.error = message
        if req.session is not None and state_lost:
            self.empty_session(req)
        self.stats.requests_failed += 1
        self.release(req, cache=False)

    def fail_batch(self, plan: list[Planned], exc: BaseException) -> None:
        """The decode raised, and has cleared the states of the batch's sequences.

        A batch of one request, or a suspect's batch, fails that request. A batch of several does not
        say whose fault it was: each of its requests becomes a suspect, its lost state is rebuilt by
        replaying its tokens, and suspects run alone until each produces output, so only a request the
        model fails on by itself fails; the others go on with the same results.
        """
        reqs = list({id(p.req): p.req for p in plan}.values())
        if not isinstance(exc, Exception):  # interrupted (Ctrl-C): the batch's requests end
            for req in reqs:
                self.fail(req, ErrorKind.MODEL, "interrupted", reason=FinishReason.ABORT)
            return
        message = f"the model failed: {type(exc).__name__}: {exc}"
        self.stats.failed_steps += 1
        self.health.step_failed(message)
        if len(reqs) == 1 or any(r.suspect for r in reqs):
            for req in reqs:
                self.fail(req, ErrorKind.MODEL, message)
            return
        for req in reqs:
            req.suspect = True
            plan_replay(req)

    def release(self, req: Request, *, cache: bool = True) -> None:
        """Finish a request: free every sequence it still holds (a session keeps its own).

        A request ended while a lost state was being replayed (``fail_batch``) holds
        sequences whose states match none of its tokens: nothing of it is cached, and its session is
        emptied."""
        if any(c.replay for c in req.completions):
            cache = False
            if req.session is not None:
                self.empty_session(req)
        if req.session is not None:
            self._end_session_request(req)
        for c in req.completions:
            if c.finish_reason is None:
                c.finish_reason = FinishReason.ABORT
            self.free_completion(c, req, cache=cache)
        self.queues.remove(req)
        if req.phase is not Phase.FINISHED:
            req.phase = Phase.FINISHED
            self.stats.requests_finished += 1
            self.ended.append(req)

    def take_ended(self) -> list[Request]:
        """The requests finished since the last call, in the order they finished."""
        ended, self.ended = self.ended, []
        return ended

    def free_completion(self, c: Completion, req: Request, *, cache: bool = True) -> None:
        """Return a finished completion's sequence; with the prompt cache, its state stays for reuse."""
        if c.seq_id < 0 or self.pool.session_of(c.seq_id) is not None:
            return
        folded: list[int] | None = None
        if cache and (c.index == 0 or req.phase is Phase.DECODE):
            folded = req.prompt_tokens[: req.n_prefilled] + c.tokens[: len(c.tokens) - 1 - c.unfed]
            if self.checkpoints is not None and c.index == 0 and folded and req.session is None:
                self.checkpoints.take(folded, c.seq_id, "end")
        # else: a failure, or a fork whose prompt never finished (nothing in its sequence)
        self.pool.release(c.seq_id, folded)
        c.seq_id = -1

    def empty_session(self, req: Request) -> None:
        """The session's state was lost or cannot be trusted: clear it; the session stays usable."""
        assert req.session is not None
        self.memory.seq_rm(req.session.seq_id, -1, -1)
        req.session.tokens, req.session.pending, req.session.busy = [], [], False
        req.session = None  # the session's sequence is not the request's to free
        req.completions[0].seq_id = -1

    def _end_session_request(self, req: Request) -> None:
        """Record what the finished request folded into the session's state."""
        session = req.session
        assert session is not None
        c = req.completions[0]
        if req.phase is Phase.DECODE:
            fed = len(c.tokens) - 1 - c.unfed  # a constraint's forced run may be waiting with the last
            session.tokens += req.prompt_tokens + c.tokens[:fed]
            session.pending = c.tokens[fed:]
        else:  # aborted during prefill: only the processed part of the prompt is in the state
            session.tokens += req.prompt_tokens[: req.n_prefilled]
            session.pending = req.prompt_tokens[req.n_prefilled :]
        session.busy = False
