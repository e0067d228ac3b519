"""Structured outputs: a request's constraint (JSON schema, grammar, regex, choice), compiled when the
request is built, and the per-completion matchers that mask a step's logits.

Rules:

- A :class:`Constraint` is checked and compiled against the engine's tokenizer before the request is
  queued (:class:`ConstraintCompiler`); a schema or grammar that does not compile, or a JSON-schema
  keyword that cannot be enforced (``uniqueItems``, ``not``, ``if``/``then``, an unknown ``format``, ...),
  is an :class:`~rsmem.errors.InvalidRequestError` naming the request field that carried it. Nothing is
  ever generated unconstrained for a constrained request.
- Each completion has its own :class:`Matcher` (``n > 1`` forks never share one). Before a step's rows are
  sampled, :func:`mask_constrained` computes the masks of every constrained row in one call into
  llguidance and sets the logits of disallowed tokens to ``-inf``; end-of-sequence is allowed only where
  the constraint is satisfied. After a token is appended, :meth:`Matcher.advance` consumes it; when
  nothing but end-of-sequence may follow, the completion finishes with ``stop``. ``max_tokens`` still
  cuts it (``length``): the text is then a prefix of a valid output.
- Where the constraint allows a single continuation (a schema's keys and punctuation), those tokens are
  appended without sampling (:func:`append_forced`) and fed to the model with the completion's next
  token as one chunk: a recurrent state takes the run in one step.
- A matcher that errors (a token it refuses, no token allowed) fails its request alone.

JSON is generated compact (``,`` and ``:`` separators, no other whitespace outside strings) unless the
schema's own ``x-guidance`` options say otherwise; llguidance's lenient mode (ignoring unknown keywords)
is always off.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rsmem.engine.tokenizer import TextTokenizer, unicode_problem
from rsmem.errors import InvalidRequestError

if TYPE_CHECKING:
    import llguidance
    from llguidance._lib import JsonCompileOptions

    from rsmem.engine.request import Completion, Request

KINDS = ("json_schema", "json_object", "grammar", "regex", "choice", "lark")
JSON_DEFAULTS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ",",
    "key_separator": ":",
}
_CACHE_SIZE = 64  # compiled constraints kept per engine (agents resend the same schema)


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match; immutable and hashable (a schema is kept as JSON text).

    ``kind`` is one of :data:`KINDS`; ``spec`` its text: the JSON schema, the GBNF grammar (as
    llama.cpp's), the regex (matched whole), a JSON list of the choices, or llguidance's Lark grammar
    (which may embed ``%json{...}`` schemas). ``field`` names the request field that asked for it, so a
    refusal names what the user wrote (``response_format.json_schema.schema``, ``--grammar``).
    Build one with the class methods: ``Constraint.json_schema({...})``, ``Constraint.grammar("root ::=
    ...")``, ``Constraint.choice(["yes", "no"])``.
    """

    kind: str
    spec: str
    field: str = "constraint"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(
                self.field, f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise InvalidRequestError(self.field, f"must be given as text, got {type(self.spec).__name__}")
        problem = unicode_problem(self.spec)
        if problem is not None:
            raise InvalidRequestError(self.field, problem)
        if self.kind in ("grammar", "regex", "lark") and not self.spec.strip():
            raise InvalidRequestError(self.field, f"is an empty {self.kind}")
        if self.kind in ("json_schema", "choice"):
            _check_json_spec(self.kind, self.spec, self.field)

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str, *, field: str = "json_schema") -> Constraint:
        """Output that is JSON valid against ``schema`` (a mapping or its JSON text)."""
        if isinstance(schema, str):
            return cls("json_schema", schema, field)
        if not isinstance(schema, Mapping):
            raise InvalidRequestError(field, f"must be a JSON object, got {type(schema).__name__}")
        try:
            return cls("json_schema", json.dumps(schema), field)
        except (TypeError, ValueError) as exc:
            raise InvalidRequestError(field, f"is not JSON: {exc}") from exc

    @classmethod
    def json_object(cls, *, field: str = "response_format") -> Constraint:
        """Any JSON object (OpenAI's ``json_object`` mode)."""
        return cls("json_object", "", field)

    @classmethod
    def grammar(cls, gbnf: str, *, field: str = "grammar") -> Constraint:
        """Output that a GBNF grammar (llama.cpp's format, ``root`` the start rule) derives."""
        return cls("grammar", gbnf, field)

    @classmethod
    def regex(cls, pattern: str, *, field: str = "regex") -> Constraint:
        """Output that matches ``pattern`` whole (Rust regex syntax, as llguidance reads it)."""
        return cls("regex", pattern, field)

    @classmethod
    def choice(cls, options: Sequence[str], *, field: str = "choice") -> Constraint:
        """Output that is exactly one of ``options``."""
        if isinstance(options, str) or not isinstance(options, Sequence):
            raise InvalidRequestError(field, f"must be a list of strings, got {type(options).__name__}")
        return cls("choice", json.dumps(list(options)), field)

    @classmethod
    def lark(cls, grammar: str, *, field: str = "grammar") -> Constraint:
        """Output that an llguidance Lark grammar derives (``%json{...}`` embeds a JSON schema)."""
        return cls("lark", grammar, field)


def _check_json_spec(kind: str, spec: str, field: str) -> None:
    try:
        value = json.loads(spec)
    except ValueError as exc:
        raise InvalidRequestError(field, f"is not valid JSON: {exc}") from exc
    if kind == "json_schema" and not isinstance(value, dict):
        raise InvalidRequestError(field, f"must be a JSON schema object, got {type(value).__name__}")
    if kind == "choice":
        if not isinstance(value, list) or not value:
            raise InvalidRequestError(field, "must be a non-empty list of strings")
        for i, option in enumerate(value):
            if not isinstance(option, str) or not option:
                raise InvalidRequestError(field, f"entry {i} must be a non-empty string, got {option!r}")


class ConstraintError(RuntimeError):
    """A matcher refused a token or allows none: its request fails."""


class Matcher:
    """One completion's position in its constraint."""

    __slots__ = ("_m", "forced_run", "vocab_size")

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int, forced_run: int = 0) -> None:
        self._m = matcher
        self.vocab_size = vocab_size  # the width of its masks (llguidance's view of the vocabulary)
        self.forced_run = forced_run  # the most forced tokens appended after a sampled one

    @property
    def llmatcher(self) -> llguidance.LLMatcher:
        return self._m

    def advance(self, token: int) -> bool:
        """Consume ``token``; True when the constraint is complete (nothing but end-of-sequence may
        follow). Raises :class:`ConstraintError` when the constraint refuses the token."""
        if not self._m.consume_token(token):
            raise ConstraintError(f"the constraint refused token {token}: {self._m.get_error()}")
        return self._m.is_stopped()

    def forced_tokens(self) -> list[int]:
        """The tokens the constraint allows as the only continuation from here (may be empty)."""
        return self._m.compute_ff_tokens()

    def clone(self) -> Matcher:
        return Matcher(self._m.deep_copy(), self.vocab_size, self.forced_run)


@dataclass(frozen=True, slots=True)
class CompiledConstraint:
    """A constraint compiled for one tokenizer; :meth:`matcher` gives each completion its own."""

    constraint: Constraint
    _start: llguidance.LLMatcher
    vocab_size: int
    forced_run: int = 0

    def matcher(self) -> Matcher:
        return Matcher(self._start.deep_copy(), self.vocab_size, self.forced_run)


class ConstraintCompiler:
    """Compiles constraints against one tokenizer (``n_vocab``: the width of the model's logits rows);
    keeps the last few compiled, so a schema sent again is not compiled again."""

    def __init__(self, tokenizer: TextTokenizer | None, n_vocab: int, forced_run: int = 0) -> None:
        self.tokenizer = tokenizer
        self.n_vocab = n_vocab
        self.forced_run = forced_run
        self._lltok: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> CompiledConstraint:
        """The compiled constraint; InvalidRequestError naming ``constraint.field`` when it cannot be
        enforced exactly."""
        import llguidance

        key = (constraint.kind, constraint.spec)
        with self._lock:
            start = self._cache.get(key)
            if start is not None:
                self._cache.move_to_end(key)
                return CompiledConstraint(constraint, start, self._vocab(), self.forced_run)
        tokenizer = self._ll_tokenizer(constraint.field)
        grammar = grammar_text(constraint)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, tokenizer)
        if is_error:
            raise InvalidRequestError(constraint.field, f"cannot be enforced: {'; '.join(messages)}")
        start = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if start.is_error():
            raise InvalidRequestError(constraint.field, f"cannot be enforced: {start.get_error()}")
        with self._lock:
            self._cache[key] = start
            while len(self._cache) > _CACHE_SIZE:
                self._cache.popitem(last=False)
        return CompiledConstraint(constraint, start, self._vocab(), self.forced_run)

    def _vocab(self) -> int:
        assert self._lltok is not None
        return self._lltok.vocab_size

    def _ll_tokenizer(self, field: str) -> llguidance.LLTokenizer:
        if self._lltok is not None:
            return self._lltok
        tok = self.tokenizer
        if tok is None:
            raise InvalidRequestError(
                field, "needs a tokenizer, and this model has none (a token-id-only engine cannot constrain)"
            )
        if tok.eos_token_id is None:
            raise InvalidRequestError(
                field, "needs an end-of-sequence token; this model's tokenizer has none"
            )
        try:
            self._lltok = _ll_tokenizer(tok, tok.eos_token_id, self.n_vocab)
        except Exception as exc:  # a tokenizer llguidance cannot read
            raise InvalidRequestError(field, f"cannot be used with this model's tokenizer: {exc}") from exc
        return self._lltok


def _ll_tokenizer(tok: TextTokenizer, eos: int, n_vocab: int) -> llguidance.LLTokenizer:
    """llguidance's view of ``tok``: a ``tokenizers.Tokenizer`` from its JSON form; a tokenizer that lists
    each token's bytes (RWKV's) through llguidance's ``TokenizerWrapper``."""
    import llguidance
    from tokenizers import Tokenizer

    inner: Any = tok.tokenizer
    if isinstance(inner, Tokenizer):
        return llguidance.LLTokenizer(
            inner.to_str(), n_vocab=max(n_vocab, inner.get_vocab_size()), eos_token=eos
        )
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_ByteTokens(inner, eos)))


class _ByteTokens:
    """What ``llguidance.TokenizerWrapper`` reads: each token's bytes, the special ids, an encoder."""

    def __init__(self, inner: Any, eos: int) -> None:
        self.tokens: list[bytes] = list(inner.tokens)
        self.eos_token_id = eos
        self.bos_token_id = None
        self.special_token_ids = sorted(getattr(inner, "special", ()))
        self._inner = inner

    def __call__(self, data: bytes) -> list[int]:
        ids: list[int] = self._inner.encode_bytes(data)[0]
        return ids


def grammar_text(c: Constraint) -> str:
    """llguidance's grammar for ``c``; InvalidRequestError naming ``c.field`` when it does not parse."""
    import llguidance

    try:
        if c.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                c.spec, defaults=JSON_DEFAULTS, overrides={"lenient": False}
            )
        if c.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema(
                {"type": "object"}, defaults=JSON_DEFAULTS, overrides={"lenient": False}
            )
        if c.kind == "grammar":
            return llguidance.grammar_from("gbnf", c.spec)
        if c.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(c.spec)
        if c.kind == "choice":
            options = json.loads(c.spec)
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(map(json.dumps, options)))
        return llguidance.LLMatcher.grammar_from_lark(c.spec)
    except ValueError as exc:
        raise InvalidRequestError(c.field, f"does not parse: {exc}") from exc


def append_forced(req: Request, c: Completion, append: Callable[..., None], *, alone: bool) -> None:
    """After ``c`` appended a sampled token: append the run of tokens its constraint allows as the only
    continuation (``append(req, c, token, None)``, as a sampled token is appended, so EOS, completion and
    ``max_tokens`` apply), without sampling them; ``c.unfed`` counts them, and the next step feeds them
    to the model with the last one as one chunk.

    Only for a completion that decoded ``alone`` in its step: in a batch, a run longer than its
    neighbours' single tokens splits the step into as many micro-batches as the run is long (a recurrent
    memory takes equal numbers of tokens from each sequence), which costs what the steps it saves would.
    Not with log-probs (a forced token has none to report)."""
    if not alone or c.matcher is None or c.finished or req.finished or req.params.logprobs is not None:
        return
    forced = c.matcher.forced_tokens()[: c.matcher.forced_run]
    if req.params.max_tokens is not None:
        forced = forced[: req.params.max_tokens - len(c.tokens)]
    for token in forced:
        c.unfed += 1
        append(req, c, token, None)
        if c.finished:
            return


# --------------------------------------------------------------------------------------------------
# Masking a step's rows
# --------------------------------------------------------------------------------------------------

_executor: llguidance.LLExecutor | None = None


def _llexecutor() -> llguidance.LLExecutor:
    global _executor
    if _executor is None:
        import llguidance

        _executor = llguidance.LLExecutor()
    return _executor


def allowed_tokens(matchers: Sequence[Matcher], n_vocab: int) -> tuple[torch.Tensor, list[str | None]]:
    """``[len(matchers), n_vocab]`` bool: the tokens each matcher allows next, computed together (the
    matchers share one tokenizer; ids it does not know are never allowed); and per matcher an error (a
    matcher in an error state, or one that allows no token) or None."""
    width = matchers[0].vocab_size
    words = (width + 31) // 32
    bits = torch.zeros(len(matchers), words, dtype=torch.int32)
    _llexecutor().unsafe_compute_mask_ptr(
        [(m.llmatcher, i) for i, m in enumerate(matchers)], bits.data_ptr(), words * 4, len(matchers)
    )
    unpacked = np.unpackbits(bits.numpy().view(np.uint8), axis=1, bitorder="little")[:, : min(width, n_vocab)]
    allowed = torch.from_numpy(unpacked).bool()
    if allowed.shape[1] < n_vocab:
        allowed = torch.nn.functional.pad(allowed, (0, n_vocab - allowed.shape[1]))
    any_allowed = allowed.any(dim=1).tolist()
    errors: list[str | None] = []
    for m, ok in zip(matchers, any_allowed):
        if m.llmatcher.is_error():
            errors.append(f"the constraint failed: {m.llmatcher.get_error()}")
        elif not ok:
            errors.append("the constraint allows no token of this model's vocabulary here")
        else:
            errors.append(None)
    return allowed, errors


FailFn = Callable[["Request", str], None]  # fail a request for its own fault, with this message


def mask_constrained(
    logits: torch.Tensor, targets: Sequence[tuple[Request, Completion]], fail: FailFn, *, owned: bool
) -> torch.Tensor:
    """``logits`` (one row per target) with every constrained row's disallowed tokens at ``-inf``: in
    place when the caller ``owned`` the tensor, else on a copy (the unconstrained case returns
    ``logits`` itself). A row whose matcher errors fails its request (``fail(request, message)``); its
    row is left as it is, and the caller skips finished requests."""
    rows = [i for i, (_, c) in enumerate(targets) if c.matcher is not None and not c.finished]
    if not rows:
        return logits
    matchers = [m for i in rows if (m := targets[i][1].matcher) is not None]
    allowed, errors = allowed_tokens(matchers, logits.shape[1])
    ok = [k for k, e in enumerate(errors) if e is None]
    for k, error in enumerate(errors):
        if error is not None:
            fail(targets[rows[k]][0], error)
    if not ok:
        return logits
    out = logits if owned else logits.clone()
    keep = [rows[k] for k in ok]
    block = allowed if len(ok) == len(rows) else allowed[ok]
    if keep == list(range(out.shape[0])):
        out.masked_fill_(~block, float("-inf"))
    else:
        index = torch.tensor(keep, dtype=torch.long)
        out[index] = out[index].masked_fill(~block, float("-inf"))
    return out
