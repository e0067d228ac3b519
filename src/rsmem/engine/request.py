"""Requests and what the engine reports about them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from rsmem.engine.sampling import SamplingParams, TokenLogprobs
from rsmem.engine.tokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from rsmem.engine.constraints import Matcher


class FinishReason(str, enum.Enum):
    STOP = "stop"  # end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"  # cancelled
    ERROR = "error"  # failed: see the output's ``error`` and ``error_kind``


class ErrorKind(str, enum.Enum):
    REQUEST = "request"  # the request's own logits/state went bad (e.g. its penalties overflowed)
    MODEL = "model"  # the model raised inside a decode step holding the request


class Phase(enum.Enum):
    WAITING = "waiting"  # queued, no sequence yet
    PREFILL = "prefill"  # prompt being folded into the first completion's sequence
    DECODE = "decode"  # completions generating
    FINISHED = "finished"


@dataclass(slots=True)
class Completion:
    """One of a request's ``n`` completions, with its own sequence, generator and text."""

    index: int
    generator: torch.Generator
    detok: IncrementalDetokenizer | None
    seq_id: int = -1
    tokens: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    text: str = ""
    finish_reason: FinishReason | None = None
    error: str | None = None  # why it failed (finish_reason ERROR)
    replay: list[int] = field(default_factory=list)  # tokens to fold in again (a lost state rebuilt)
    reported_chars: int = 0  # text already sent in reports
    reported_tokens: int = 0
    matcher: Matcher | None = None  # the request's constraint, at this completion's position in it
    unfed: int = 0  # tokens before tokens[-1] not yet in the state (a constraint's forced run)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class Session:
    """A conversation that keeps its sequence (and so its state) between requests.

    ``tokens`` are folded into the state; ``pending`` were sampled but not yet fed to the model (a
    request's last token), and go in front of the next prompt, so nothing is processed twice.
    """

    seq_id: int
    tokens: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    busy: bool = False
    closed: bool = False


@dataclass(slots=True)
class Follow:
    """A waiting request's wait for ``leader``, a request being prefilled whose prompt shares its first
    ``n_tokens``: the leader's checkpoint there will serve both (see ``engine/admission.py``)."""

    leader: Request
    n_tokens: int
    steps_left: int  # the wait ends after this many more steps, whatever the leader did


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_tokens: list[int]
    params: SamplingParams
    completions: list[Completion]
    prompt_text: str | None = None
    phase: Phase = Phase.WAITING
    n_prefilled: int = 0
    session: Session | None = None
    slot: int | None = None  # a sequence id the request must run in (its first completion)
    n_cached: int = 0  # prompt tokens a cached state covered (never processed)
    error_kind: ErrorKind | None = None
    suspect: bool = False  # in a batch the model failed on: runs alone until it produces output
    boundaries: tuple[int, ...] = ()  # prompt positions worth a checkpoint (e.g. chat message ends)
    checkpoint_at: list[int] = field(default_factory=list)  # prompt positions to checkpoint, sorted
    follow: Follow | None = None  # waiting for a leader's checkpoint of a shared prefix
    followed: bool = False  # has waited for a leader once (it never waits again)
    _prompt_ids: tuple[int, ...] | None = field(default=None, repr=False)

    def prompt_ids(self) -> tuple[int, ...]:
        """``prompt_tokens`` as a tuple, made once (every report carries it)."""
        if self._prompt_ids is None or len(self._prompt_ids) != len(self.prompt_tokens):
            self._prompt_ids = tuple(self.prompt_tokens)
        return self._prompt_ids

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    @property
    def prefill_seq(self) -> int:
        return self.completions[0].seq_id


@dataclass(frozen=True, slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprobs, ...] | None
    delta_text: str = ""  # new since the previous report of this request
    delta_token_ids: tuple[int, ...] = ()
    error: str | None = None


@dataclass(frozen=True, slots=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    outputs: tuple[CompletionOutput, ...]
    finished: bool
    prompt: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prompt cache
    error: str | None = None  # the first completion error, if the request failed
    error_kind: ErrorKind | None = None

    @property
    def text(self) -> str:
        """The first completion's text (the usual case, ``n = 1``)."""
        return self.outputs[0].text
