"""Text <-> tokens for the engine, and incremental detokenization for streaming."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers import Tokenizer

from rsmem.errors import InvalidRequestError


def unicode_problem(text: str) -> str | None:
    """Why ``text`` is not Unicode text (a lone UTF-16 surrogate, which JSON's ``\\ud800`` escapes and
    Python strings can hold, has no UTF-8 form), or None when it is."""
    if text.isascii():
        return None
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        surrogate = f"U+{ord(text[exc.start]):04X}"
        return f"is not valid Unicode text: a lone surrogate {surrogate} at character {exc.start}"
    return None


def check_text(text: str, name: str) -> None:
    """InvalidRequestError naming the field ``name`` unless ``text`` is a string of Unicode text."""
    if not isinstance(text, str):
        raise InvalidRequestError(name, f"must be a string, got {type(text).__name__}")
    problem = unicode_problem(text)
    if problem is not None:
        raise InvalidRequestError(name, problem)


@dataclass(slots=True)
class TextTokenizer:
    """A ``tokenizers.Tokenizer`` with the special ids the engine needs (GGUF keeps them apart)."""

    tokenizer: Tokenizer
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    def encode(self, text: str, name: str = "prompt") -> list[int]:
        """The tokens of ``text``; InvalidRequestError naming the field ``name`` when it is not Unicode
        text."""
        check_text(text, name)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_with_ends(self, text: str, name: str = "prompt") -> tuple[list[int], list[int]]:
        """The tokens of ``text`` and where each ends in it (a character offset, non-decreasing)."""
        check_text(text, name)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        ends, last = [], 0
        for _, end in enc.offsets:
            last = max(last, end)
            ends.append(last)
        return enc.ids, ends

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def token_text(self, token: int) -> str:
        return self.tokenizer.decode([token], skip_special_tokens=False)


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without decoding the whole list each step.

    Byte-level BPE can split a UTF-8 character over several tokens; while the decoded tail ends in the
    replacement character the delta is held back until the character is complete. Decoding restarts
    from ``prefix`` (a few tokens before the unread part) so every step costs O(new tokens).
    """

    tokenizer: TextTokenizer
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    _prefix: int = 0
    _read: int = 0

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes (possibly empty)."""
        self.tokens.append(token)
        before = self.tokenizer.decode(self.tokens[self._prefix : self._read])
        after = self.tokenizer.decode(self.tokens[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            delta = after[len(before) :]
            self._prefix, self._read = self._read, len(self.tokens)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (a truncated character at the very end)."""
        rest = self.tokenizer.decode(self.tokens[self._prefix :])[
            len(self.tokenizer.decode(self.tokens[self._prefix : self._read])) :
        ]
        self._prefix = self._read = len(self.tokens)
        self.text += rest
        return rest
