"""The generation engine: continuous batching of many requests over one ``Context``.

Each ``step()`` is schedule -> run -> post-process:

- **schedule**: waiting requests take free sequences (all ``n`` of them at once, FIFO), or wait for a
  request being prefilled that shares their prefix (``engine/admission.py``); then the plan: every
  decoding completion contributes its last sampled token, prompts being prefilled contribute chunks from
  what is left of the per-step token budget (``max_batch_tokens``), so a long prompt never stalls
  decoding. Planning changes nothing; the queues are the scheduler's (``scheduler.RequestQueues``);
- **run**: one ``Context.decode`` for the whole batch; only once it succeeded do prompts advance and
  statistics count, and a prompt whose last chunk ran is forked into its other completions with
  ``seq_cp`` (the prompt is processed once);
- **post-process**: every row that produced logits is sampled in one vectorised call; completions that
  hit EOS, a stop string or ``max_tokens`` free their sequence at once; every request that progressed
  or ended gets a report.

Failures stay with the requests they belong to. If the model raises inside the decode, the requests of
that batch finish with ``FinishReason.ERROR`` (``error_kind`` "model"), their sequences cleared and
nothing of them cached; the others never noticed. If one request's logits cannot be sampled (its
penalties overflowed, its state went NaN), that request alone fails (``error_kind`` "request"). The
engine stays usable after any failure; ``snapshot().health`` says whether failures are recent.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator, Sequence

from rsmem.context import Context
from rsmem.engine.admission import Admission
from rsmem.engine.checkpoints import DEFAULT_DISK_BYTES, CheckpointCache
from rsmem.engine.kept import KeptSequences
from rsmem.engine.lifecycle import Lifecycle
from rsmem.engine.output import OutputProcessor
from rsmem.engine.pool import SequencePool
from rsmem.engine.reports import report
from rsmem.engine.request import FinishReason, Phase, Request, RequestOutput, Session
from rsmem.engine.reuse import PromptReuse
from rsmem.engine.sampling import Sampler, SamplingParams
from rsmem.engine.scheduler import Planned, RequestQueues, StepCost, build_batch, plan_step, step_caps
from rsmem.engine.snapshot import active_cells, take_snapshot
from rsmem.engine.status import EngineSnapshot, EngineStats, Health
from rsmem.engine.tokenizer import TextTokenizer
from rsmem.engine.validation import RequestBuilder, RequestLimits
from rsmem.errors import InvalidRequestError
from rsmem.threads import one_thread_below

Prompt = str | Sequence[int]


class Engine:
    """Runs requests to completion with continuous batching; not thread-safe (one loop drives it)."""

    def __init__(
        self,
        context: Context,
        tokenizer: TextTokenizer | None = None,
        *,
        max_batch_tokens: int | None = None,
        prompt_cache: bool = False,
        max_prompt_tokens: int | None = None,
        max_tokens_limit: int | None = None,
        cache_bytes: int = 0,
        checkpoint_interval: int = 0,
        checkpoint_codec: str = "exact",
        cache_dir: str | os.PathLike[str] | None = None,
        cache_disk_bytes: int = DEFAULT_DISK_BYTES,
        prefill_cap: int | None = None,
    ) -> None:
        """``cache_bytes`` > 0 keeps a prefix cache of checkpoints of that many bytes (see
        ``engine/checkpoints.py``), also every ``checkpoint_interval`` prompt tokens, in
        ``checkpoint_codec``; with ``cache_dir`` the checkpoints are kept there too (up to
        ``cache_disk_bytes``), and found again by an engine started later (``engine/cache_dir.py``).
        ``prefill_cap``: the most prompt tokens one prompt gets in a step while other requests run (see
        ``scheduler.plan_step``): None learns it from the steps' costs (and then also bounds a lone
        prompt's steps, ``StepCost.alone_cap``; while requests wait for a sequence, ``StepCost.ceiling``
        bounds both, see ``scheduler.step_caps``), 0 lets a prompt take the whole budget."""
        self.ctx = context
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens or context.n_batch
        if self.max_batch_tokens > context.n_batch:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} exceeds n_batch {context.n_batch}")
        if context.n_seq_max > self.max_batch_tokens:  # one decode token per sequence must fit a step
            raise ValueError(
                f"n_seq_max {context.n_seq_max} exceeds the per-step token budget {self.max_batch_tokens}"
            )
        if prefill_cap is not None and prefill_cap < 0:
            raise ValueError(f"prefill_cap must be >= 0 or None, got {prefill_cap}")
        self.prefill_cap = prefill_cap
        self.step_cost = StepCost()
        self.limits = RequestLimits(
            context.n_vocab,
            context.n_seq_max,
            max_prompt_tokens,
            max_tokens_limit,
            context.max_seq_tokens,
            forced_run=self.max_batch_tokens // context.n_seq_max - 1,  # every sequence's run fits a step
        )
        memory = context.memory
        self.pool = SequencePool(
            context.n_seq_max,
            self._clear_seq,
            prompt_cache=prompt_cache,
            trim=lambda seq, n: memory.seq_rm(seq, n, -1),
            rollback_depth=context.n_rs_seq,
        )
        self.queues = RequestQueues()
        self.requests: dict[str, Request] = {}
        self.stats = EngineStats()
        self.health = Health()
        self.checkpoints = (
            CheckpointCache.for_context(
                context,
                cache_bytes,
                interval=checkpoint_interval,
                codec=checkpoint_codec,
                cache_dir=cache_dir,
                disk_bytes=cache_disk_bytes,
            )
            if cache_bytes > 0
            else None
        )
        self.reuse = PromptReuse(self.pool, self.checkpoints, self.stats, memory)
        self.kept = KeptSequences(context, self.pool, self.checkpoints, self.reuse)
        self.builder = RequestBuilder(self.limits, tokenizer)
        self.lifecycle = Lifecycle(memory, self.pool, self.checkpoints, self.stats, self.health, self.queues)
        self.admission = Admission(
            self.pool, self.reuse, self.checkpoints, self.stats, self.queues, self.lifecycle
        )
        self.output = OutputProcessor(Sampler(), tokenizer, self.stats, self.lifecycle)

    @property
    def prompt_cache(self) -> bool:
        return self.pool.prompt_cache

    @property
    def running(self) -> Sequence[Request]:
        """The requests holding sequences, in admission order (read only)."""
        return self.queues.running

    # --------------------------------------------------------------- submit

    def add_request(
        self,
        prompt: Prompt,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        session: Session | None = None,
        slot: int | None = None,
        boundaries: Sequence[int] = (),
    ) -> str:
        """Queue a prompt (text, or token ids); returns its request id.

        Everything is checked here, before anything is queued (:class:`InvalidRequestError` names the
        field). With a ``session`` the prompt continues the session's state (only the new tokens are
        processed) and the state is kept when the request ends; ``n`` must then be 1.
        """
        req = self._build(prompt, params or SamplingParams(), request_id, session, slot, set())
        req.boundaries = tuple(boundaries)
        self._queue(req)
        return req.request_id

    def add_requests(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        request_ids: Sequence[str] | None = None,
        slot: int | None = None,
    ) -> list[str]:
        """Queue several prompts together (they are batched together): all are checked first, and
        either all are queued or none."""
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise InvalidRequestError("params", f"has {len(params)} entries for {len(prompts)} prompts")
        if request_ids is not None and len(request_ids) != len(prompts):
            raise InvalidRequestError("request_id", f"has {len(request_ids)} ids for {len(prompts)} prompts")
        taken: set[str] = set()
        reqs = []
        for k, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
            rid = request_ids[k] if request_ids is not None else None
            try:
                reqs.append(self._build(prompt, sp, rid, None, slot, taken))
            except InvalidRequestError as exc:
                raise InvalidRequestError(exc.param, f"(prompt {k}) {exc.detail}") from exc
            taken.add(reqs[-1].request_id)
        for req in reqs:
            self._queue(req)
        return [r.request_id for r in reqs]

    def _build(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None,
        session: Session | None,
        slot: int | None,
        taken: set[str],
    ) -> Request:
        return self.builder.build(
            prompt,
            params,
            request_id,
            session=session,
            slot=slot,
            held=self.pool.held,
            in_use=lambda rid: rid in self.requests or rid in taken,
        )

    def _queue(self, req: Request) -> None:
        if req.session is not None:
            req.session.busy = True
            req.session.pending = []
        self.requests[req.request_id] = req
        self.queues.add(req)

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its sequences now; False if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        for c in req.completions:
            if not c.finished:
                c.finish_reason = FinishReason.ABORT
        self.lifecycle.release(req)
        return True

    @property
    def has_unfinished(self) -> bool:
        """Requests wait or run, or have finished without a report yet (aborted, interrupted)."""
        return bool(self.queues.n_waiting or self.queues.n_running) or len(self.requests) > 0

    def capacity(self) -> tuple[int, int, int]:
        """(sequences, free sequences, sequences the waiting requests need): a cheap read for admission
        control, unlike :meth:`snapshot`."""
        waiting = sum(r.params.n for r in self.queues.waiting)
        return self.ctx.n_seq_max, self.pool.n_free, waiting

    def request_progress(self, request_id: str) -> tuple[int, int] | None:
        """(prompt tokens processed, prompt length) of a live request; None if unknown or finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return None
        return req.n_prefilled, len(req.prompt_tokens)

    # ----------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns a report for every request that made progress or finished.

        A failure belongs to the requests it came from (see the module docstring); ``step`` raises only
        for ``KeyboardInterrupt`` and the like, after failing the interrupted batch's requests.
        """
        plan = self._schedule()
        decoded = self._run(plan)
        return self._post_process(plan if decoded else [])

    def _schedule(self) -> list[Planned]:
        """Admit waiting requests, then plan the next batch (the plan changes nothing)."""
        self.admission.admit()
        cap, alone = step_caps(self.prefill_cap, self.step_cost, queued=self.queues.n_waiting > 0)
        return plan_step(
            self.queues.running,
            self.max_batch_tokens,
            cap,
            alone_cap=alone,
            cut_at_checkpoints=not self.reuse.captures,
        )

    def _run(self, plan: list[Planned]) -> bool:
        """Decode the plan's batch and commit it; False when there was nothing to run or the decode
        failed (its requests then fail or replay, see ``Lifecycle.fail_batch``)."""
        if not plan:
            return False
        batch = build_batch(plan)
        n_tokens = sum(p.n_tokens for p in plan)
        self.reuse.make_room(n_tokens)  # cached states give way in shared cells
        capture = self.reuse.capture_points(plan)
        codec = self.checkpoints.codec if self.checkpoints is not None else "exact"
        t0 = time.perf_counter()
        try:  # on failure decode has cleared the batch's sequences
            self.ctx.decode(batch, capture=capture, capture_codec=codec)
        except BaseException as exc:
            self.lifecycle.fail_batch(plan, exc)
            if not isinstance(exc, Exception):
                raise
            return False
        elapsed = time.perf_counter() - t0
        self.stats.decode_seconds += elapsed
        self.step_cost.observe(n_tokens, elapsed)
        self.stats.steps += 1
        self.health.step_succeeded()
        self._commit(plan)
        return True

    def _post_process(self, decoded: list[Planned]) -> list[RequestOutput]:
        """Sample the ``decoded`` plan's output rows, then report every request that progressed or
        ended."""
        touched: dict[str, Request] = {}
        if decoded:
            # one thread: the sampler's operations are small, and a parallel region waits for a partner
            # thread that a busy machine may not schedule for a whole time slice
            with one_thread_below(0, 1):
                self.output.process(decoded, self.ctx.logits, touched)
        for req in self.lifecycle.take_ended():  # not a scan of every request: the queue may be long
            touched[req.request_id] = req
            self.requests.pop(req.request_id, None)
        return [report(r) for r in touched.values()]

    def _commit(self, plan: list[Planned]) -> None:
        """The decode succeeded: prompts and replays advance, finished prompts fork into their other
        completions, and a suspect that produced output is trusted again."""
        captured = self.ctx.captured() if self.reuse.captures else {}
        for part in plan:
            req, c = part.req, part.completion
            if part.output:
                req.suspect = False
            if c is not None:
                if not part.output:  # a replay chunk
                    del c.replay[: part.n_tokens]
                else:  # the last token, with a forced run before it
                    c.unfed = 0
                continue
            start = req.n_prefilled
            req.n_prefilled += part.n_tokens
            self.stats.prompt_tokens += part.n_tokens
            self.reuse.keep(req, start, captured)
            if part.output:  # the prompt is in
                for other in req.completions[1:]:
                    self.ctx.memory.seq_cp(req.prefill_seq, other.seq_id)
                req.phase = Phase.DECODE

    # ---------------------------------------------------- sessions and slots

    def open_session(self, path: str | None = None) -> Session:
        """Reserve a sequence for a conversation; with ``path``, restore a saved sequence file into it."""
        return self.kept.open_session(path)

    def save_session(self, session: Session, path: str) -> int:
        """Write the session's state and tokens to a llama.cpp sequence file; returns bytes written."""
        return self.kept.save_session(session, path)

    def close_session(self, session: Session) -> None:
        """Forget the conversation and return its sequence."""
        self.kept.close_session(session)

    def slot_save(self, slot: int, path: str) -> tuple[int, int]:
        """Save an idle slot's cached state and tokens to a sequence file; returns (tokens, bytes)."""
        return self.kept.slot_save(slot, path)

    def slot_restore(self, slot: int, path: str) -> int:
        """Load a sequence file into an idle slot; returns the number of tokens it holds."""
        return self.kept.slot_restore(slot, path)

    def slot_erase(self, slot: int) -> int:
        """Drop an idle slot's cached state; returns the number of tokens it held."""
        return self.kept.slot_erase(slot)

    def snapshot(self) -> EngineSnapshot:
        """The engine's state in one read (for servers: call it on the thread that drives the engine)."""
        return take_snapshot(
            self.ctx.memory, self.pool, self.queues, self.stats, self.health, self.checkpoints
        )

    def active_cells(self) -> int:
        """Cells held by running requests and sessions (the rest of ``memory.used`` is cache)."""
        return active_cells(self.ctx.memory, self.pool)

    def _clear_seq(self, seq: int) -> None:
        self.ctx.memory.seq_rm(seq, -1, -1)

    def run_until_done(self) -> Iterator[RequestOutput]:
        """Step until nothing is left, yielding every report."""
        while self.has_unfinished:
            yield from self.step()
