"""The one place a generation request is checked before it is queued.

``SamplingParams`` checks each field's own range when it is built; :func:`check_request` checks what
depends on the engine: the vocabulary, the number of sequences, the slots and sessions, and the limits
a server sets. Each refusal is an :class:`~rsmem.errors.InvalidRequestError` naming the field.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rsmem.engine.constraints import ConstraintCompiler
from rsmem.engine.request import Completion, Request, Session
from rsmem.engine.sampling import SamplingParams, make_generator
from rsmem.engine.tokenizer import IncrementalDetokenizer, TextTokenizer
from rsmem.errors import InvalidRequestError


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What the engine accepts: its vocabulary and sequences, and optional server limits."""

    n_vocab: int
    n_seq_max: int
    max_prompt_tokens: int | None = None
    max_tokens: int | None = None
    max_context: int | None = None  # positions one sequence holds (a hybrid's KV cells per sequence)
    forced_run: int = 0  # the most tokens a constraint may force after a sampled one (fed in its step)


def check_params(params: SamplingParams, limits: RequestLimits) -> None:
    if params.n > limits.n_seq_max:
        raise InvalidRequestError(
            "n", f"= {params.n} completions need more sequences than there are ({limits.n_seq_max})"
        )
    if limits.max_tokens is not None:
        if params.max_tokens is None:
            raise InvalidRequestError("max_tokens", f"must be set (at most {limits.max_tokens})")
        if params.max_tokens > limits.max_tokens:
            raise InvalidRequestError(
                "max_tokens", f"{params.max_tokens} exceeds the limit of {limits.max_tokens}"
            )
    for token, _ in params.logit_bias or ():  # type: ignore[misc]
        if token >= limits.n_vocab:
            raise InvalidRequestError(
                "logit_bias", f"names token {token}, outside the vocabulary [0, {limits.n_vocab})"
            )


def check_prompt(tokens: list[int], limits: RequestLimits) -> None:
    if not tokens:
        raise InvalidRequestError("prompt", "is empty (and the model has no BOS token to start from)")
    for i, t in enumerate(tokens):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < limits.n_vocab:
            raise InvalidRequestError(
                "prompt", f"token {i}: id {t!r} is outside the vocabulary [0, {limits.n_vocab})"
            )
    if limits.max_prompt_tokens is not None and len(tokens) > limits.max_prompt_tokens:
        raise InvalidRequestError(
            "prompt", f"has {len(tokens)} tokens, more than the limit of {limits.max_prompt_tokens}"
        )


def fit_context(
    tokens: list[int], params: SamplingParams, limits: RequestLimits, session: Session | None
) -> SamplingParams:
    """Refuse a prompt (with a session's history) longer than a sequence's context; cap ``max_tokens`` so
    generation ends (``length``) where the context is full. A request's last sampled token is never
    decoded, except in a session: its next request or a save decodes it, so a session keeps it a cell."""
    if limits.max_context is None:
        return params
    held = len(session.tokens) if session is not None else 0
    total = held + len(tokens)
    cells = limits.max_context - (session is not None)  # what the prompt and the reply may fill
    if total > cells:
        history = f" ({held} of them the session's history)" if held else ""
        reply = ", less one for the reply in a session" if session is not None else ""
        raise InvalidRequestError(
            "prompt",
            f"has {total} tokens{history}, more than the max context of {limits.max_context} tokens a "
            f"sequence holds{reply} (the KV cache: --ctx-size / n_ctx, divided among the sequences "
            "unless --kv-unified)",
        )
    room = cells - total + 1
    if params.max_tokens is None or params.max_tokens > room:
        return dataclasses.replace(params, max_tokens=room)
    return params


def check_placement(
    params: SamplingParams,
    limits: RequestLimits,
    *,
    session: Session | None,
    slot: int | None,
    held: set[int],
) -> None:
    """A session must be open and idle, and generate one completion; other requests must fit in the
    sequences sessions do not hold (``held``); a slot must exist and be free of sessions."""
    if session is not None:
        if params.n != 1:
            raise InvalidRequestError("n", f"must be 1 for a session request, got {params.n}")
        if session.closed or session.busy:
            state = "closed" if session.closed else "busy"
            raise InvalidRequestError("session", f"on sequence {session.seq_id} is {state}")
    elif params.n > limits.n_seq_max - len(held):
        raise InvalidRequestError(
            "n",
            f"= {params.n} completions need {params.n} sequences, but sessions hold {len(held)} of the "
            f"{limits.n_seq_max}: the request could never start (close a session first)",
        )
    if slot is not None:
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < limits.n_seq_max:
            last = limits.n_seq_max - 1
            raise InvalidRequestError("slot", f"{slot!r} does not exist: slots are 0 to {last}")
        if slot in held:
            raise InvalidRequestError("slot", f"{slot} is held by a session")


class RequestBuilder:
    """Turns a prompt and its parameters into a checked :class:`Request` (nothing is queued here)."""

    def __init__(self, limits: RequestLimits, tokenizer: TextTokenizer | None) -> None:
        self.limits = limits
        self.tokenizer = tokenizer
        self.constraints = ConstraintCompiler(tokenizer, limits.n_vocab, limits.forced_run)
        self._ids = itertools.count()

    def build(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None,
        *,
        session: Session | None,
        slot: int | None,
        held: set[int],
        in_use: Callable[[str], bool],
    ) -> Request:
        check_params(params, self.limits)
        check_placement(params, self.limits, session=session, slot=slot, held=held)
        compiled = self.constraints.compile(params.constraint) if params.constraint is not None else None
        prompt_text = prompt if isinstance(prompt, str) else None
        tokens = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if session is not None:
            tokens = session.pending + tokens
        check_prompt(tokens, self.limits)
        params = fit_context(tokens, params, self.limits, session)
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while in_use(request_id):
                request_id = f"req-{next(self._ids)}"
        elif in_use(request_id):
            raise InvalidRequestError("request_id", f"{request_id!r} is already in use")
        completions = [
            Completion(
                index=i,
                generator=make_generator(None if params.seed is None else params.seed + i),
                detok=IncrementalDetokenizer(self.tokenizer) if self.tokenizer else None,
                matcher=compiled.matcher() if compiled is not None else None,
            )
            for i in range(params.n)
        ]
        return Request(request_id, tokens, params, completions, prompt_text, session=session, slot=slot)

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("prompt", "is text, but this model has no tokenizer: pass token ids")
        tokens = self.tokenizer.encode(text)
        if self.tokenizer.bos_token_id is not None and not tokens:
            tokens = [self.tokenizer.bos_token_id]
        return tokens
