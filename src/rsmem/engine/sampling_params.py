"""Sampling parameters: what a request may ask of the sampler, each field checked against its documented
range (:class:`SamplingParams`), and the per-request generator."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rsmem.engine.constraints import Constraint
from rsmem.engine.tokenizer import unicode_problem
from rsmem.errors import InvalidRequestError

# torch.Generator.manual_seed accepts exactly this range (negative seeds are folded onto positive ones).
_SEED_MIN = -(2**63)
_SEED_MAX = 2**64 - 1

LogitBias = tuple[tuple[int, float], ...]


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A fresh generator for one request; ``None`` seeds it from ``os.urandom``.

    One generator per request (rather than torch's global one) is what makes a seeded request
    reproducible whatever else runs in the same batch.
    """
    if seed is None:
        seed = int.from_bytes(os.urandom(8), "little")
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


# --------------------------------------------------------------------------------------------------
# Parameters
# --------------------------------------------------------------------------------------------------


def _fail(name: str, value: object, rule: str) -> InvalidRequestError:
    return InvalidRequestError(name, f"must be {rule}, got {value!r}")


def _as_int(name: str, value: object) -> int:
    # bool is an int subclass; True as a top_k is almost surely a bug, so refuse it.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _fail(name, value, "an int")
    return value


def _as_float(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(name, value, "a float")
    if not math.isfinite(value):
        raise _fail(name, value, "finite")
    return float(value)


def _normalise_bias(value: object) -> LogitBias | None:
    """Turn a mapping or pair sequence into sorted ``(token, bias)`` pairs, which keep the params hashable.

    ``-inf`` bans a token; ``+inf`` and NaN are refused because they would make softmax undefined.
    """
    if value is None:
        return None
    items: Any = value.items() if isinstance(value, Mapping) else value
    try:
        pairs = [tuple(item) for item in items]
    except TypeError as exc:
        raise _fail("logit_bias", value, "a mapping of token id to bias") from exc
    bias: dict[int, float] = {}
    for pair in pairs:
        if len(pair) != 2:
            raise _fail("logit_bias", value, "a mapping of token id to bias")
        token, amount = pair
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise _fail("logit_bias", value, f"keyed by token ids >= 0 (bad key {token!r})")
        if isinstance(amount, bool) or not isinstance(amount, (int, float)):
            raise _fail("logit_bias", value, f"valued by floats (bad value {amount!r})")
        if math.isnan(amount) or amount == math.inf:
            raise _fail("logit_bias", value, f"finite or -inf (bad value {amount!r} for token {token})")
        if token in bias:
            raise _fail("logit_bias", value, f"free of duplicate tokens (token {token} repeats)")
        bias[token] = float(amount)
    return tuple(sorted(bias.items())) or None


def _normalise_stop(value: object) -> tuple[str, ...]:
    # A bare string would otherwise become a tuple of its characters.
    given: Any = (value,) if isinstance(value, str) else value
    try:
        stops: tuple[object, ...] = tuple(given)
    except TypeError as exc:
        raise _fail("stop", value, "a tuple of strings") from exc
    for s in stops:
        if not isinstance(s, str) or not s:
            raise _fail("stop", value, f"non-empty strings (bad entry {s!r})")
        problem = unicode_problem(s)
        if problem is not None:  # no text the model writes can contain it
            raise InvalidRequestError("stop", f"entry {s!r} {problem}")
    return stops  # type: ignore[return-value]  # checked above: every entry is a str


MAX_LOGPROBS = 20
GREEDY_BELOW = 1e-5  # temperatures below this are greedy
_INT_MAX = 2**31 - 1
_FLOAT_RANGES: dict[str, tuple[float, float, str]] = {
    "temperature": (0.0, 1e4, "in [0, 1e4] (0 means greedy)"),
    "top_p": (0.0, 1.0, "in (0, 1]"),
    "min_p": (0.0, 1.0, "in [0, 1]"),
    "repetition_penalty": (1e-3, 1e3, "in [1e-3, 1e3] (1 means off)"),
    "presence_penalty": (-1e3, 1e3, "in [-1e3, 1e3]"),
    "frequency_penalty": (-1e3, 1e3, "in [-1e3, 1e3]"),
}
_INT_RANGES: dict[str, tuple[int, int, str]] = {
    "top_k": (0, _INT_MAX, ">= 0 (0 means off)"),
    "penalty_last_n": (-1, _INT_MAX, ">= -1 (-1 means the whole history)"),
    "n": (1, _INT_MAX, ">= 1"),
}


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """How one request picks its tokens; validated on construction, immutable and hashable.

    ``temperature`` 0 means greedy. ``top_k`` 0, ``top_p`` 1 and ``min_p`` 0 switch those stages off.
    ``repetition_penalty`` (llama.cpp/HF style) divides positive and multiplies negative logits of
    tokens seen in the last ``penalty_last_n`` tokens of prompt + output (-1: all, 0: no penalties);
    ``presence_penalty``/``frequency_penalty`` (OpenAI style) subtract ``presence*[count>0] +
    frequency*count``. ``logit_bias`` is stored as sorted ``(token, bias)`` pairs (a mapping is
    accepted); ``-inf`` bans a token. ``logprobs`` is the number of top alternatives to report (0: only
    the chosen token's log-prob, None: nothing). ``max_tokens``, ``stop``, ``n`` and ``ignore_eos`` are
    for the engine's stopping and forking logic; the sampler itself does not read them.

    Ranges, checked here (an :class:`~rsmem.errors.InvalidRequestError` naming the field otherwise). The
    bounds keep every stage finite in float32 for finite logits, so no valid request can overflow:

    ====================== ================= ==============================================
    field                  range             off / meaning
    ====================== ================= ==============================================
    temperature            [0, 1e4]          0 (and anything below 1e-5): greedy
    top_k                  [0, 2**31-1]      0: off
    top_p                  (0, 1]            1: off
    min_p                  [0, 1]            0: off
    repetition_penalty     [1e-3, 1e3]       1: off
    presence_penalty       [-1e3, 1e3]       0: off
    frequency_penalty      [-1e3, 1e3]       0: off
    penalty_last_n         [-1, 2**31-1]     -1: the whole history, 0: no penalties
    logit_bias             token ids >= 0    values finite or -inf (bans the token)
    seed                   [-2**63, 2**64-1] None: drawn from os.urandom
    logprobs               [0, 20]           None: no log-probs
    max_tokens             >= 1              None: no limit (EOS, a stop string or abort)
    n                      [1, 2**31-1]      completions (the engine also bounds it by its sequences)
    stop                   non-empty strings
    constraint             a Constraint      None: free text; with one, ``stop`` must be empty
    ====================== ================= ==============================================

    ``constraint`` (:class:`~rsmem.engine.constraints.Constraint`) makes every completion match a JSON
    schema, grammar, regex or choice; the engine compiles it when the request is built. Stop strings
    are refused with it: one could cut the output short of what the constraint requires.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    penalty_last_n: int = 64
    logit_bias: LogitBias | Mapping[int, float] | None = None
    seed: int | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    stop: tuple[str, ...] = ()
    n: int = 1
    ignore_eos: bool = False
    constraint: Constraint | None = None

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalised values are stored through object.__setattr__
        for name, (low, high, rule) in _FLOAT_RANGES.items():
            value = _as_float(name, getattr(self, name))
            if not (low <= value <= high) or (name == "top_p" and value == 0.0):
                raise _fail(name, value, rule)
            set_(self, name, value)
        for name, (low, high, rule) in _INT_RANGES.items():
            if not low <= _as_int(name, getattr(self, name)) <= high:
                raise _fail(name, getattr(self, name), rule)
        self._validate_optional_ints()
        if not isinstance(self.ignore_eos, bool):
            raise _fail("ignore_eos", self.ignore_eos, "a bool")
        set_(self, "logit_bias", _normalise_bias(self.logit_bias))
        set_(self, "stop", _normalise_stop(self.stop))
        if self.constraint is not None:
            if not isinstance(self.constraint, Constraint):
                raise _fail("constraint", self.constraint, "a Constraint or None")
            if self.stop:
                raise InvalidRequestError(
                    "stop", "cannot be combined with a constraint: a stop string could cut its output short"
                )

    def _validate_optional_ints(self) -> None:
        if self.seed is not None and not _SEED_MIN <= _as_int("seed", self.seed) <= _SEED_MAX:
            raise _fail("seed", self.seed, f"in [{_SEED_MIN}, {_SEED_MAX}]")
        if self.logprobs is not None and not 0 <= _as_int("logprobs", self.logprobs) <= MAX_LOGPROBS:
            raise _fail("logprobs", self.logprobs, f"in [0, {MAX_LOGPROBS}] or None")
        if self.max_tokens is not None and _as_int("max_tokens", self.max_tokens) < 1:
            raise _fail("max_tokens", self.max_tokens, ">= 1 or None (no limit)")

    @classmethod
    def greedy(cls, **overrides: object) -> SamplingParams:
        """Argmax decoding (``temperature=0``); other fields may be overridden."""
        return cls(temperature=0.0, **overrides)  # type: ignore[arg-type]

    @property
    def is_greedy(self) -> bool:
        """Temperatures below ``GREEDY_BELOW`` pick the argmax, as vLLM does: dividing by them would
        overflow float32, and what they sample from is the argmax within float precision."""
        return self.temperature < GREEDY_BELOW

    @property
    def has_penalties(self) -> bool:
        """Whether the penalty stage changes anything, i.e. whether the sampler needs the history."""
        active = (
            self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        )
        return active and self.penalty_last_n != 0
