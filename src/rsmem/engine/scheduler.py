"""Scheduling: what the next batch holds, as a plan that changes nothing until the engine commits it.

A plan lists, in batch order, each request's part: one decode token per running completion first, then
replays (a lost state rebuilt from its tokens) and prompt chunks from what is left of the token budget,
so a long prompt never stalls decoding. A suspect request (in a batch the model failed on) runs alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from rsmem.batch.batch import Batch
from rsmem.engine.request import Completion, Phase, Request


@dataclass(slots=True)
class Planned:
    """One request's part of a planned batch: a decode token of ``completion``, or a prompt chunk."""

    req: Request
    completion: Completion | None  # None: a chunk of the prompt
    n_tokens: int
    output: bool  # this part's last token produces a logits row


def plan_step(running: list[Request], budget: int) -> list[Planned]:
    """What the next batch holds, in batch order: decode tokens first, then replays and prompt chunks
    from what is left of the budget. A suspect request (see ``_fail_batch``) runs alone. Changes
    nothing."""
    suspect = next((r for r in running if r.suspect), None)
    if suspect is not None:
        running = [suspect]
    plan = [
        Planned(req, c, 1, True)
        for req in running
        if req.phase is Phase.DECODE
        for c in req.completions
        if not c.finished and not c.replay
    ]
    budget -= len(plan)
    for req in running:
        if budget <= 0:
            break
        if req.phase is Phase.DECODE:
            for c in req.completions:
                if c.replay and not c.finished and budget > 0:
                    n = min(budget, len(c.replay))
                    budget -= n
                    plan.append(Planned(req, c, n, False))
            continue
        c0 = req.completions[0]
        if c0.replay:
            n = min(budget, len(c0.replay))
            budget -= n
            plan.append(Planned(req, c0, n, False))
            continue
        n = min(budget, len(req.prompt_tokens) - req.n_prefilled)
        stop = next((p for p in req.checkpoint_at if p > req.n_prefilled), None)
        if stop is not None:  # a chunk ends where a checkpoint is to be taken
            n = min(n, stop - req.n_prefilled)
        budget -= n
        plan.append(Planned(req, None, n, req.n_prefilled + n == len(req.prompt_tokens)))
    return plan


def build_batch(plan: list[Planned]) -> Batch:
    tokens: list[int] = []
    seq_ids: list[list[int]] = []
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
        else:
            tokens.append(c.tokens[-1])
            seq = c.seq_id
        seq_ids.extend([seq] for _ in range(part.n_tokens))
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
