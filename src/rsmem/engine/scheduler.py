"""Scheduling: the engine's queues, and what the next batch holds, as a plan that changes nothing until
the engine commits it.

``RequestQueues`` owns the requests waiting for sequences and those running; admission, the lifecycle
and the snapshot go through it.

A plan lists, in batch order, each request's part: one decode token per running completion first, then
replays (a lost state rebuilt from its tokens) and prompt chunks from what is left of the token budget,
so a long prompt never stalls decoding. A suspect request (in a batch the model failed on) runs alone.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from rsmem.batch.batch import Batch
from rsmem.engine.request import Completion, Phase, Request


class RequestQueues:
    """The requests not yet ended: ``waiting`` for sequences (in arrival order), then ``running``
    (in admission order). An ended request is in neither."""

    def __init__(self) -> None:
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []

    def add(self, req: Request) -> None:
        """Queue ``req`` behind the waiting requests."""
        self._waiting.append(req)

    def admit(self, req: Request) -> None:
        """``req`` took its sequences: it leaves the waiting queue and runs after the running requests."""
        self._waiting.remove(req)
        self._running.append(req)

    def remove(self, req: Request) -> None:
        """``req`` ended: it leaves the queue it is in (none if it already left)."""
        for queue in (self._running, self._waiting):
            if req in queue:
                queue.remove(req)
                return

    @property
    def waiting(self) -> Sequence[Request]:
        """The waiting requests, oldest first (read only: change them through the methods)."""
        return self._waiting

    @property
    def running(self) -> Sequence[Request]:
        """The running requests, in admission order (read only: change them through the methods)."""
        return self._running

    @property
    def n_waiting(self) -> int:
        return len(self._waiting)

    @property
    def n_running(self) -> int:
        return len(self._running)


@dataclass(slots=True)
class Planned:
    """One request's part of a planned batch: a decode token of ``completion``, or a prompt chunk."""

    req: Request
    completion: Completion | None  # None: a chunk of the prompt
    n_tokens: int
    output: bool  # this part's last token produces a logits row


def plan_step(
    running: Sequence[Request],
    budget: int,
    prefill_cap: int | None = None,
    *,
    alone_cap: int | None = None,
    cut_at_checkpoints: bool = True,
) -> list[Planned]:
    """What the next batch holds, in batch order: decode tokens first, then replays and prompt chunks
    from what is left of the budget. A suspect request (see ``Lifecycle.fail_batch``) runs alone. Changes
    nothing.

    Prompts share the budget fairly: the oldest prompt being prefilled is served first (it always makes
    progress), then the others shortest-remaining first, so a short prompt arriving behind a long one
    is in the next step. While anything else runs (decodes, other prompts) a prompt gets at most
    ``prefill_cap`` tokens a step, which keeps steps short for the others; alone it gets ``alone_cap``
    (None or 0: the budget), which bounds how long a request arriving during its step waits.
    With ``cut_at_checkpoints`` a chunk ends where a checkpoint is due (for a context that cannot
    capture states inside a micro-batch).
    """
    suspect = next((r for r in running if r.suspect), None)
    if suspect is not None:
        running = [suspect]
    plan = [
        Planned(req, c, 1 + c.unfed, True)  # with the tokens a constraint forced after it
        for req in running
        if req.phase is Phase.DECODE
        for c in req.completions
        if not c.finished and not c.replay
    ]
    budget -= sum(p.n_tokens for p in plan)
    prompts: list[Request] = []
    for req in running:
        if budget <= 0:
            break
        replays = req.completions if req.phase is Phase.DECODE else req.completions[:1]
        for c in replays:
            if c.replay and not c.finished and budget > 0:
                n = min(budget, len(c.replay))
                budget -= n
                plan.append(Planned(req, c, n, False))
        if req.phase is Phase.PREFILL and not req.completions[0].replay:
            prompts.append(req)
    if prompts and budget > 0:
        contended = len(plan) > 0 or len(prompts) > 1
        cap = (prefill_cap if contended else alone_cap) or budget
        oldest, rest = prompts[0], sorted(prompts[1:], key=_remaining)
        order = [oldest, *rest]
        if contended and prefill_cap:
            # prompts this step finishes run alone (with the decodes): their first tokens come a short
            # step later; the others wait one step for each such prompt, and go on with the next
            finishing = [r for r in sorted(prompts, key=_remaining) if _finishes(r, cap, cut_at_checkpoints)]
            order = finishing or order
        for req in order:
            if budget <= 0:
                break
            n = _chunk(req, min(budget, cap), cut_at_checkpoints)
            budget -= n
            plan.append(Planned(req, None, n, req.n_prefilled + n == len(req.prompt_tokens)))
    return plan


def _remaining(req: Request) -> int:
    return len(req.prompt_tokens) - req.n_prefilled


def _finishes(req: Request, most: int, cut: bool) -> bool:
    return _chunk(req, most, cut) == _remaining(req)


def _chunk(req: Request, most: int, cut: bool) -> int:
    """The next chunk of ``req``'s prompt: at most ``most`` tokens (with ``cut``, ending where a
    checkpoint is due)."""
    n = min(most, len(req.prompt_tokens) - req.n_prefilled)
    stop = next((p for p in req.checkpoint_at if p > req.n_prefilled), None) if cut else None
    if stop is not None:  # a chunk ends where a checkpoint is to be taken
        n = min(n, stop - req.n_prefilled)
    return n


class StepCost:
    """What a step costs, learnt from the steps run: ``fixed`` seconds plus ``per_token`` a token.

    ``prefill_cap()`` is the chunk a prompt gets while others run: the tokens whose cost matches a
    step's fixed cost, so a step carrying it costs at most about twice a step without it (a short
    request's first token waits at most that), within ``[floor, ceiling]``. ``alone_cap()`` is the chunk
    of a prompt running alone: ``ALONE`` times that, so a request arriving during its step waits at most
    about ``ALONE + 1`` fixed costs for it, while the lone prompt loses at most ~1/``ALONE`` of its speed
    to the steps' fixed costs.
    """

    ALONE = 4

    def __init__(self, *, floor: int = 32, ceiling: int = 512, alpha: float = 0.2) -> None:
        self.floor, self.ceiling, self.alpha = floor, ceiling, alpha
        self.fixed: float | None = None  # seconds of a step of a few tokens
        self.per_token: float | None = None  # seconds a token, from steps of many

    def observe(self, n_tokens: int, seconds: float) -> None:
        if n_tokens <= 8:
            self.fixed = _ewma(self.fixed, seconds, self.alpha)
        elif self.fixed is not None and n_tokens >= 32:
            rate = max(seconds - self.fixed, 0.0) / n_tokens
            self.per_token = _ewma(self.per_token, rate, self.alpha)

    def prefill_cap(self) -> int:
        if self.fixed is None or not self.per_token:
            return self.ceiling  # nothing learnt yet: no cap beyond the budget's
        return max(self.floor, min(self.ceiling, round(self.fixed / self.per_token)))

    def alone_cap(self) -> int | None:
        """None (the budget) until the costs are learnt."""
        if self.fixed is None or not self.per_token:
            return None
        return min(self.ceiling, self.ALONE * self.prefill_cap())


def step_caps(setting: int | None, cost: StepCost, *, queued: bool = False) -> tuple[int | None, int | None]:
    """The ``prefill_cap`` and ``alone_cap`` of :func:`plan_step` for an engine's setting: learnt ones
    (None) bound both; a cap set by hand (0: none) leaves a lone prompt the budget.

    While requests are ``queued`` (they wait for a sequence: the engine is saturated), learnt caps give
    way to ``cost.ceiling``: the queued requests' first tokens wait on throughput, and each chunk pays
    the prompt path's fixed cost (on a small model several decode steps' worth), so small chunks cost
    them more than they save the running decodes. A new request cannot start before a sequence frees,
    so nobody waits on a long step the way a short prompt beside a long one would."""
    if setting is not None:
        return setting, None
    if queued:
        return cost.ceiling, cost.ceiling
    return cost.prefill_cap(), cost.alone_cap()


def _ewma(old: float | None, new: float, alpha: float) -> float:
    return new if old is None else (1 - alpha) * old + alpha * new


def build_batch(plan: list[Planned]) -> Batch:
    tokens: list[int] = []
    seq_ids: list[tuple[int]] = []
    logits: list[bool] = []
    for part in plan:
        c = part.completion
        if c is None:
            start = part.req.n_prefilled
            tokens.extend(part.req.prompt_tokens[start : start + part.n_tokens])
            seq = part.req.prefill_seq
        elif c.replay:
            tokens.extend(c.replay[: part.n_tokens])
            seq = c.seq_id
        elif c.unfed:
            tokens.extend(c.tokens[-1 - c.unfed :])
            seq = c.seq_id
        else:
            tokens.append(c.tokens[-1])
            seq = c.seq_id
        seq_ids += [(seq,)] * part.n_tokens
        logits.extend([False] * (part.n_tokens - 1) + [part.output])
    return Batch(tokens, seq_ids=seq_ids, logits=logits)


def plan_replay(req: Request) -> None:
    """Plan the replay of what ``req``'s sequences held (their states were cleared)."""
    base = list(req.session.tokens) if req.session is not None else []
    if req.phase is Phase.PREFILL:
        req.completions[0].replay = base
        req.n_prefilled = 0
        return
    for c in req.completions:
        if not c.finished:
            c.replay = base + req.prompt_tokens + c.tokens[:-1]
            c.unfed = 0
