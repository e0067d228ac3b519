"""The generation engine: continuous batching of many requests over one ``Context``.

Each ``step()`` is schedule -> run -> post-process:

- **schedule**: waiting requests take free sequences (all ``n`` of them at once, FIFO); every decoding
  completion contributes its last sampled token; prompts being prefilled contribute chunks from what is
  left of the per-step token budget (``max_batch_tokens``), so a long prompt never stalls decoding.
- **run**: one ``Context.decode`` for the whole batch.
- **post-process**: a prompt whose last chunk ran is forked into its other completions with ``seq_cp``
  (the prompt is processed once); every row that produced logits is sampled in one vectorised call;
  completions that hit EOS, a stop string or ``max_tokens`` free their sequence at once.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from rsmem.batch.batch import Batch
from rsmem.context import Context
from rsmem.engine.request import (
    Completion,
    CompletionOutput,
    FinishReason,
    Phase,
    Request,
    RequestOutput,
    Session,
)
from rsmem.engine.sampling import Sampler, SamplingParams, TokenLogprobs, make_generator
from rsmem.engine.tokenizer import IncrementalDetokenizer, TextTokenizer


@dataclass(slots=True)
class EngineStats:
    """Running totals, for reports and the server's metrics."""

    steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0
    decode_seconds: float = 0.0
    requests_finished: int = 0


class Engine:
    """Runs requests to completion with continuous batching; not thread-safe (one loop drives it)."""

    def __init__(
        self,
        context: Context,
        tokenizer: TextTokenizer | None = None,
        *,
        max_batch_tokens: int | None = None,
        prompt_cache: bool = False,
    ) -> None:
        self.ctx = context
        self.tokenizer = tokenizer
        self.max_batch_tokens = max_batch_tokens or context.n_batch
        if self.max_batch_tokens > context.n_batch:
            raise ValueError(f"max_batch_tokens {self.max_batch_tokens} exceeds n_batch {context.n_batch}")
        if context.n_seq_max > self.max_batch_tokens:  # one decode token per sequence must fit a step
            raise ValueError(
                f"n_seq_max {context.n_seq_max} exceeds the per-step token budget {self.max_batch_tokens}"
            )
        self.sampler = Sampler()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.free_seqs: list[int] = list(range(context.n_seq_max))[::-1]  # pop() gives the lowest id
        self.stats = EngineStats()
        self._ids = itertools.count()
        self._sessions: dict[int, Session] = {}  # seq id -> session holding it
        # Prompt cache: a finished request's sequence keeps its state; a new prompt that extends the
        # cached tokens continues from it instead of processing them again. Oldest entry first.
        self.prompt_cache = prompt_cache
        self.cached: dict[int, list[int]] = {}

    # --------------------------------------------------------------- submit

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        session: Session | None = None,
        slot: int | None = None,
    ) -> str:
        """Queue a prompt (text, or token ids); returns its request id.

        With a ``session`` the prompt continues the session's state (only the new tokens are
        processed) and the state is kept when the request ends; ``n`` must then be 1.
        """
        params = params or SamplingParams()
        if session is not None:
            if params.n != 1:
                raise ValueError(f"a session request generates one completion, not n = {params.n}")
            if session.closed or session.busy:
                raise ValueError(
                    f"session on sequence {session.seq_id} is {'closed' if session.closed else 'busy'}"
                )
        if slot is not None and not 0 <= slot < self.ctx.n_seq_max:
            raise ValueError(f"slot {slot} does not exist: slots are 0 to {self.ctx.n_seq_max - 1}")
        if slot is not None and slot in self._sessions:
            raise ValueError(f"slot {slot} is held by a session")
        if params.n > self.ctx.n_seq_max:
            raise ValueError(
                f"n = {params.n} completions need more sequences than n_seq_max = {self.ctx.n_seq_max}"
            )
        prompt_text = prompt if isinstance(prompt, str) else None
        tokens = self._encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        if session is not None:
            tokens = session.pending + tokens
        if not tokens:
            raise ValueError("the prompt is empty (and the model has no BOS token to start from)")
        for i, t in enumerate(tokens):
            if not 0 <= t < self.ctx.n_vocab:
                raise ValueError(
                    f"prompt token {i}: id {t} is outside the vocabulary [0, {self.ctx.n_vocab})"
                )
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        completions = [
            Completion(
                index=i,
                generator=make_generator(None if params.seed is None else params.seed + i),
                detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None,
            )
            for i in range(params.n)
        ]
        req = Request(request_id, tokens, params, completions, prompt_text, session=session, slot=slot)
        if session is not None:
            session.busy = True
            session.pending = []
        self.requests[request_id] = req
        self.waiting.append(req)
        return request_id

    def _encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError("this model has no tokenizer: pass token ids instead of text")
        tokens = self.tokenizer.encode(text)
        if self.tokenizer.bos_token_id is not None and not tokens:
            tokens = [self.tokenizer.bos_token_id]
        return tokens

    def abort(self, request_id: str) -> bool:
        """Cancel a request and free its sequences now; False if it is unknown or already finished."""
        req = self.requests.get(request_id)
        if req is None or req.finished:
            return False
        for c in req.completions:
            if not c.finished:
                c.finish_reason = FinishReason.ABORT
        self._release(req)
        return True

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----------------------------------------------------------------- step

    def step(self) -> list[RequestOutput]:
        """Run one batch; returns a report for every request that made progress or finished."""
        self._admit()
        batch, rows = self._schedule()
        touched: dict[str, Request] = {}
        if batch is not None:
            t0 = time.perf_counter()
            self.ctx.decode(batch)
            self.stats.decode_seconds += time.perf_counter() - t0
            self.stats.steps += 1
            self._sample(rows, touched)
        finished_now = [r for r in self.requests.values() if r.finished]
        for req in finished_now:
            touched[req.request_id] = req
            del self.requests[req.request_id]
        return [self._report(r) for r in touched.values()]

    def _admit(self) -> None:
        """Give waiting requests their sequences, in arrival order (a blocked head blocks the rest)."""
        while self.waiting:
            req = self.waiting[0]
            if req.finished:  # aborted while waiting
                self.waiting.popleft()
                continue
            if req.session is not None:
                first = req.session.seq_id
            elif req.slot is not None:
                if req.slot not in self.free_seqs or len(self.free_seqs) < req.params.n:
                    break
                first = req.slot
            elif len(self.free_seqs) >= req.params.n:
                first = self._best_free_seq(req.prompt_tokens)
            else:
                break
            self.waiting.popleft()
            if req.session is None:
                self._take_seq(first, reuse_for=req)
            req.completions[0].seq_id = first
            for c in req.completions[1:]:
                c.seq_id = self._best_free_seq([])
                self._take_seq(c.seq_id, reuse_for=None)
            req.phase = Phase.PREFILL
            self.running.append(req)

    def _best_free_seq(self, prompt: list[int]) -> int:
        """The free sequence whose cached state covers most of ``prompt``; else one holding no cache;
        else the one cached longest ago."""
        best, best_len = -1, 0
        for seq, tokens in self.cached.items():
            if (
                seq in self.free_seqs
                and best_len < len(tokens) < len(prompt)
                and prompt[: len(tokens)] == tokens
            ):
                best, best_len = seq, len(tokens)
        if best >= 0:
            return best
        uncached = [s for s in self.free_seqs if s not in self.cached]
        if uncached:
            return min(uncached)
        return next(s for s in self.cached if s in self.free_seqs)

    def _take_seq(self, seq: int, reuse_for: Request | None) -> None:
        """Take a free sequence; keep its cached state only if it is a proper prefix of the prompt."""
        self.free_seqs.remove(seq)
        tokens = self.cached.pop(seq, None)
        if tokens is None:
            return
        prompt = reuse_for.prompt_tokens if reuse_for is not None else []
        if len(tokens) < len(prompt) and prompt[: len(tokens)] == tokens and reuse_for is not None:
            reuse_for.n_prefilled = len(tokens)
            self.stats.cached_prompt_tokens += len(tokens)
            return
        self.ctx.memory.seq_rm(seq, -1, -1)

    def _schedule(self) -> tuple[Batch | None, list[tuple[Request, Completion | None]]]:
        """The next batch and, per output row in batch order, whose logits they are.

        A row's completion is None for a prompt's last chunk: all ``n`` completions sample from it.
        """
        tokens: list[int] = []
        seq_ids: list[list[int]] = []
        logits: list[bool] = []
        rows: list[tuple[Request, Completion | None]] = []
        for req in self.running:
            if req.phase is Phase.DECODE:
                for c in req.completions:
                    if not c.finished:
                        tokens.append(c.tokens[-1])
                        seq_ids.append([c.seq_id])
                        logits.append(True)
                        rows.append((req, c))
        budget = self.max_batch_tokens - len(tokens)
        for req in self.running:
            if req.phase is not Phase.PREFILL or budget <= 0:
                continue
            chunk = req.prompt_tokens[req.n_prefilled : req.n_prefilled + budget]
            budget -= len(chunk)
            req.n_prefilled += len(chunk)
            done = req.n_prefilled == len(req.prompt_tokens)
            tokens.extend(chunk)
            seq_ids.extend([req.prefill_seq] for _ in chunk)
            logits.extend([False] * (len(chunk) - 1) + [done])
            self.stats.prompt_tokens += len(chunk)
            if done:
                rows.append((req, None))
        if not tokens:
            return None, []
        return Batch(tokens, seq_ids=seq_ids, logits=logits), rows

    def _sample(self, rows: list[tuple[Request, Completion | None]], touched: dict[str, Request]) -> None:
        logit_rows: list[int] = []
        targets: list[tuple[Request, Completion]] = []
        for k, (req, comp) in enumerate(rows):
            if comp is None:  # the prompt is in: fork it into the other completions' sequences
                for c in req.completions[1:]:
                    self.ctx.memory.seq_cp(req.prefill_seq, c.seq_id)
                req.phase = Phase.DECODE
                for c in req.completions:
                    logit_rows.append(k)
                    targets.append((req, c))
            else:
                logit_rows.append(k)
                targets.append((req, comp))
        if not targets:
            return
        logits = self.ctx.logits[torch.tensor(logit_rows, dtype=torch.long)]
        params = [req.params for req, _ in targets]
        histories = (
            [req.prompt_tokens + c.tokens for req, c in targets]
            if any(p.has_penalties for p in params)
            else None
        )
        out = self.sampler.sample(logits, params, histories, [c.generator for _, c in targets])
        for i, (req, c) in enumerate(targets):
            self._append(req, c, out.tokens[i], out.logprobs[i])
            touched[req.request_id] = req
        for req in {id(r): r for r, _ in targets}.values():
            if all(c.finished for c in req.completions):
                self._release(req)

    def _append(self, req: Request, c: Completion, token: int, logprob: TokenLogprobs | None) -> None:
        self.stats.generated_tokens += 1
        c.tokens.append(token)
        if logprob is not None:
            c.logprobs.append(logprob)
        eos = self.tokenizer.eos_token_id if self.tokenizer else None
        if token == eos and not req.params.ignore_eos:
            self._finish(req, c, FinishReason.STOP)
            return
        if c.detok is not None:
            delta = c.detok.push(token)
            c.text += delta
            if req.params.stop and self._cut_at_stop(c, req.params.stop, len(delta)):
                self._finish(req, c, FinishReason.STOP, flush=False)
                return
        if len(c.tokens) >= req.params.max_tokens:
            self._finish(req, c, FinishReason.LENGTH)

    @staticmethod
    def _cut_at_stop(c: Completion, stops: tuple[str, ...], n_new: int) -> bool:
        """Cut the text at the first stop string that the newest text completes; True if one did.

        Reports hold back any tail that could still grow into a stop string, so the cut never removes
        text a client has already seen.
        """
        start = max(0, len(c.text) - n_new - max(map(len, stops)) + 1)
        hits = [i for s in stops if (i := c.text.find(s, start)) >= 0]
        if not hits:
            return False
        c.text = c.text[: min(hits)]
        return True

    def _finish(self, req: Request, c: Completion, reason: FinishReason, *, flush: bool = True) -> None:
        if flush and c.detok is not None:
            c.text += c.detok.flush()
        c.finish_reason = reason
        self._free_completion(c, req)

    def _free_completion(self, c: Completion, req: Request) -> None:
        """Return a finished completion's sequence; with the prompt cache, its state stays for reuse."""
        if c.seq_id < 0 or self._is_session_seq(c.seq_id):
            return
        if c.index == 0 or req.phase is Phase.DECODE:
            folded = req.prompt_tokens[: req.n_prefilled] + c.tokens[:-1]
        else:
            folded = []  # a fork whose prompt never finished: nothing in its sequence
        if self.prompt_cache and folded:
            self.cached[c.seq_id] = folded
        else:
            self.ctx.memory.seq_rm(c.seq_id, -1, -1)
        self.free_seqs.append(c.seq_id)
        c.seq_id = -1

    def _release(self, req: Request) -> None:
        """Finish a request: free every sequence it still holds (a session keeps its own)."""
        if req.session is not None:
            self._end_session_request(req)
        for c in req.completions:
            if c.finish_reason is None:
                c.finish_reason = FinishReason.ABORT
            self._free_completion(c, req)
        if req in self.running:
            self.running.remove(req)
        if req.phase is not Phase.FINISHED:
            req.phase = Phase.FINISHED
            self.stats.requests_finished += 1

    def _report(self, req: Request) -> RequestOutput:
        outs = []
        for c in req.completions:
            end = len(c.text) if c.finished else len(c.text) - _stop_prefix_len(c.text, req.params.stop)
            delta_text = c.text[c.reported_chars : end]
            delta_tokens = tuple(c.tokens[c.reported_tokens :])
            c.reported_chars = max(c.reported_chars, end)
            c.reported_tokens = len(c.tokens)
            outs.append(
                CompletionOutput(
                    index=c.index,
                    text=c.text if c.finished else c.text[:end],
                    token_ids=tuple(c.tokens),
                    finish_reason=c.finish_reason,
                    logprobs=tuple(c.logprobs) if req.params.logprobs is not None else None,
                    delta_text=delta_text,
                    delta_token_ids=delta_tokens,
                )
            )
        return RequestOutput(
            req.request_id, tuple(req.prompt_tokens), tuple(outs), req.finished, req.prompt_text
        )

    # ------------------------------------------------------------ sessions

    def open_session(self, path: str | None = None) -> Session:
        """Reserve a sequence for a conversation; with ``path``, restore a saved sequence file into it."""
        if not self.free_seqs:
            raise RuntimeError("no free sequence for a session: every sequence is in use")
        seq = self._best_free_seq([])
        self._take_seq(seq, reuse_for=None)
        session = Session(seq)
        if path is not None:
            try:
                session.tokens = self.ctx.state_seq_load_file(path, seq)
            except BaseException:
                self.free_seqs.append(seq)
                raise
        self._sessions[seq] = session
        return session

    def save_session(self, session: Session, path: str) -> int:
        """Write the session's state and tokens to a llama.cpp sequence file; returns bytes written.

        A pending token (sampled, not yet in the state) is decoded first so the file is complete.
        """
        if session.busy:
            raise RuntimeError("the session has a request running; save it when the request is done")
        if session.pending:
            self.ctx.decode(Batch(session.pending, seq_ids=[[session.seq_id]] * len(session.pending)))
            session.tokens += session.pending
            session.pending = []
        return self.ctx.state_seq_save_file(path, session.seq_id, session.tokens)

    def close_session(self, session: Session) -> None:
        """Forget the conversation and return its sequence."""
        if session.busy:
            raise RuntimeError("the session has a request running")
        if not session.closed:
            self.ctx.memory.seq_rm(session.seq_id, -1, -1)
            self.free_seqs.append(session.seq_id)
            del self._sessions[session.seq_id]
            session.closed = True

    # ---------------------------------------------------------------- slots

    def _idle_slot(self, slot: int) -> None:
        if not 0 <= slot < self.ctx.n_seq_max:
            raise ValueError(f"slot {slot} does not exist: slots are 0 to {self.ctx.n_seq_max - 1}")
        if slot not in self.free_seqs:
            raise RuntimeError(f"slot {slot} is busy")

    def slot_save(self, slot: int, path: str) -> tuple[int, int]:
        """Save an idle slot's cached state and tokens to a sequence file; returns (tokens, bytes)."""
        self._idle_slot(slot)
        tokens = self.cached.get(slot, [])
        return len(tokens), self.ctx.state_seq_save_file(path, slot, tokens)

    def slot_restore(self, slot: int, path: str) -> int:
        """Load a sequence file into an idle slot; a prompt extending its tokens continues from it."""
        self._idle_slot(slot)
        tokens = self.ctx.state_seq_load_file(path, slot)
        self.cached.pop(slot, None)
        if tokens or self.ctx.memory.seq_pos_max(slot) >= 0:
            self.cached[slot] = tokens
        return len(tokens)

    def slot_erase(self, slot: int) -> int:
        """Drop an idle slot's cached state; returns the number of tokens it held."""
        self._idle_slot(slot)
        self.ctx.memory.seq_rm(slot, -1, -1)
        return len(self.cached.pop(slot, []))

    def slots(self) -> list[dict[str, object]]:
        """Per slot: whether it is busy and how many tokens of state it caches."""
        running = {c.seq_id: r.request_id for r in self.running for c in r.completions if c.seq_id >= 0}
        return [
            {
                "id": s,
                "busy": s in running or s in self._sessions,
                "request_id": running.get(s),
                "n_cached_tokens": len(self.cached.get(s, [])),
            }
            for s in range(self.ctx.n_seq_max)
        ]

    def active_cells(self) -> int:
        """Cells held by running requests and sessions (the rest of ``memory.used`` is cache)."""
        return sum(
            1
            for s in range(self.ctx.n_seq_max)
            if s not in self.free_seqs and self.ctx.memory.seq_pos_max(s) >= 0
        )

    def _is_session_seq(self, seq: int) -> bool:
        return seq in self._sessions

    def _end_session_request(self, req: Request) -> None:
        """Record what the finished request folded into the session's state."""
        session = req.session
        assert session is not None
        c = req.completions[0]
        if req.phase is Phase.DECODE:
            session.tokens += req.prompt_tokens + c.tokens[:-1]
            session.pending = c.tokens[-1:]
        else:  # aborted during prefill: only the processed part of the prompt is in the state
            session.tokens += req.prompt_tokens[: req.n_prefilled]
            session.pending = req.prompt_tokens[req.n_prefilled :]
        session.busy = False

    # ------------------------------------------------------------ helpers

    def run_until_done(self) -> Iterator[RequestOutput]:
        """Step until nothing is left, yielding every report."""
        while self.has_unfinished:
            yield from self.step()


def _stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best
