"""Output processing: sampling a step's logits rows, then EOS, stop strings and lengths.

Every row that produced logits is sampled in one vectorised call. A request whose rows cannot be
sampled (its penalties overflowed, its state went NaN) fails alone; its neighbours' draws are untouched
because the sampler checks every row before drawing any.
"""

from __future__ import annotations

import torch

from rsmem.engine.constraints import append_forced, mask_constrained
from rsmem.engine.lifecycle import Lifecycle
from rsmem.engine.reports import cut_at_stop
from rsmem.engine.request import Completion, ErrorKind, FinishReason, Request
from rsmem.engine.sampling import Sampler, TokenLogprobs
from rsmem.engine.scheduler import Planned
from rsmem.engine.status import EngineStats
from rsmem.engine.tokenizer import TextTokenizer


class OutputProcessor:
    def __init__(
        self, sampler: Sampler, tokenizer: TextTokenizer | None, stats: EngineStats, lifecycle: Lifecycle
    ) -> None:
        self.sampler = sampler
        self.eos = tokenizer.eos_token_id if tokenizer is not None else None
        self.stats = stats
        self.lifecycle = lifecycle

    def process(self, plan: list[Planned], step_logits: torch.Tensor, touched: dict[str, Request]) -> None:
        """Sample every output row of ``plan`` (``step_logits``: the decode's rows in plan order) and
        append the tokens; a request whose rows fail fails alone. Every request sampled goes in
        ``touched``."""
        rows: list[int] = []
        targets: list[tuple[Request, Completion]] = []
        for k, part in enumerate(p for p in plan if p.output):
            for c in [part.completion] if part.completion is not None else part.req.completions:
                rows.append(k)
                targets.append((part.req, c))
        if not targets:
            return
        in_order = len(rows) == step_logits.shape[0] and rows == list(range(len(rows)))
        logits = step_logits if in_order else step_logits[torch.tensor(rows, dtype=torch.long)]
        by_request: dict[str, list[int]] = {}
        for i, (req, _) in enumerate(targets):
            by_request.setdefault(req.request_id, []).append(i)
        params = [req.params for req, _ in targets]
        histories = (
            [penalty_window(req.prompt_tokens, c.tokens, req.params.penalty_last_n) for req, c in targets]
            if any(p.has_penalties for p in params)
            else None
        )
        fail = self.lifecycle.fail
        logits = mask_constrained(  # structured outputs
            logits,
            targets,
            lambda req, message: fail(req, ErrorKind.REQUEST, message, state_lost=False),
            owned=not in_order,
        )
        try:  # a bad row is reported in out.errors; only a bug raises here
            out = self.sampler.sample(logits, params, histories, [c.generator for _, c in targets])
        except Exception as exc:
            for idx in by_request.values():
                fail(targets[idx[0]][0], ErrorKind.REQUEST, f"sampling failed: {exc}", state_lost=False)
            return
        for idx in by_request.values():
            bad = [i for i in idx if out.errors[i] is not None]
            if bad:
                bad_state = not bool(torch.isfinite(logits[bad]).all())
                message = _sampling_error(out.errors[bad[0]] or "", bad_state)
                fail(targets[idx[0]][0], ErrorKind.REQUEST, message, state_lost=bad_state)
        for idx in by_request.values():
            req = targets[idx[0]][0]
            touched[req.request_id] = req
            if req.finished:
                continue
            try:
                for i in idx:
                    self._append(req, targets[i][1], out.tokens[i], out.logprobs[i])
                    append_forced(req, targets[i][1], self._append, alone=len(targets) == 1)
            except Exception as exc:
                fail(req, ErrorKind.REQUEST, f"post-processing failed: {exc}")
                continue
            if all(c.finished for c in req.completions):
                self.lifecycle.release(req)

    def _append(self, req: Request, c: Completion, token: int, logprob: TokenLogprobs | None) -> None:
        self.stats.generated_tokens += 1
        c.tokens.append(token)
        if logprob is not None:
            c.logprobs.append(logprob)
        finish = self.lifecycle.finish
        if token == self.eos and not req.params.ignore_eos:
            finish(req, c, FinishReason.STOP)
            return
        if c.detok is not None:
            delta = c.detok.push(token)
            c.text += delta
            if req.params.stop and cut_at_stop(c, req.params.stop, len(delta)):
                finish(req, c, FinishReason.STOP, flush=False)
                return
        if c.matcher is not None and c.matcher.advance(token):  # the constraint is complete
            finish(req, c, FinishReason.STOP)
            return
        if req.params.max_tokens is not None and len(c.tokens) >= req.params.max_tokens:
            finish(req, c, FinishReason.LENGTH)


def penalty_window(prompt: list[int], generated: list[int], n: int) -> list[int]:
    """The last ``n`` tokens of prompt + generated (all of them for -1), without joining whole lists."""
    if n < 0:
        return prompt + generated
    if n <= len(generated):
        return generated[len(generated) - n :]
    return prompt[max(0, len(prompt) - (n - len(generated))) :] + generated


def _sampling_error(detail: str, bad_state: bool) -> str:
    if bad_state:
        return "the model produced non-finite logits for this request (its state is not finite)"
    return f"its sampling parameters made the logits unusable: {detail}"
