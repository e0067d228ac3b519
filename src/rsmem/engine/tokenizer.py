"""Text <-> tokens for the engine, and incremental detokenization for streaming."""

from __future__ import annotations

import codecs
import json
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
    _pieces: list[bytes] | None = field(default=None, init=False, repr=False, compare=False)
    _pieces_known: bool = field(default=False, init=False, repr=False, compare=False)

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

    def byte_pieces(self) -> list[bytes] | None:
        """Each token's bytes as :meth:`decode` joins them (special tokens: none), when decoding is the
        concatenation of per-token bytes (a byte-level BPE: GPT-2's, NeoX's, Qwen's); else None. Made at
        the first call."""
        if not self._pieces_known:
            self._pieces = _byte_level_pieces(self.tokenizer)
            self._pieces_known = True
        return self._pieces


def _gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character that stands for each byte in a byte-level BPE vocabulary."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1)]
    printable += range(ord("\u00ae"), ord("\u00ff") + 1)
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _byte_level_pieces(tokenizer: Tokenizer) -> list[bytes] | None:
    """Per-token bytes of a byte-level BPE tokenizer whose decoder is ByteLevel alone; None for any other
    (a SentencePiece decoder strips and replaces by position, so its text is not a concatenation)."""
    if not isinstance(tokenizer, Tokenizer):  # e.g. RWKV's own tokenizer, which decodes whole bytes itself
        return None
    decoder = json.loads(tokenizer.to_str()).get("decoder") or {}
    if decoder.get("type") != "ByteLevel":
        return None
    table = _gpt2_byte_decoder()
    special = {i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special}
    pieces: list[bytes] = []
    for i in range(tokenizer.get_vocab_size(with_added_tokens=True)):
        token = tokenizer.id_to_token(i)
        if token is None or i in special:
            pieces.append(b"")
        elif all(c in table for c in token):
            pieces.append(bytes(table[c] for c in token))
        else:  # an added token in plain text: its decoded text, when that is whole characters
            text = tokenizer.decode([i], skip_special_tokens=True)
            if "\ufffd" in text:
                return None
            pieces.append(text.encode("utf-8"))
    return pieces


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a growing token list into text deltas without decoding the whole list each step.

    Byte-level BPE can split a UTF-8 character over several tokens; an incomplete character is held back
    until it is complete. With a byte-level tokenizer (:meth:`TextTokenizer.byte_pieces`) each token adds
    its bytes to an incremental UTF-8 decoder (bytes that can never be valid become U+FFFD, as in
    :meth:`TextTokenizer.decode`). Otherwise decoding restarts from ``prefix`` (a few tokens before the
    unread part), and a delta whose decoded tail ends in the replacement character is held back, so every
    step costs O(new tokens).
    """

    tokenizer: TextTokenizer
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    _prefix: int = 0
    _read: int = 0
    _pieces: list[bytes] | None = None
    _utf8: codecs.IncrementalDecoder | None = None

    def __post_init__(self) -> None:
        self._pieces = self.tokenizer.byte_pieces()
        if self._pieces is not None:
            self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def push(self, token: int) -> str:
        """Add one token; returns the text it completes (possibly empty)."""
        self.tokens.append(token)
        if self._utf8 is not None and self._pieces is not None:
            delta = self._utf8.decode(self._pieces[token]) if 0 <= token < len(self._pieces) else ""
            self.text += delta
            return delta
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
        if self._utf8 is not None:
            rest = self._utf8.decode(b"", final=True)
            self.text += rest
            return rest
        rest = self.tokenizer.decode(self.tokens[self._prefix :])[
            len(self.tokenizer.decode(self.tokens[self._prefix : self._read])) :
        ]
        self._prefix = self._read = len(self.tokens)
        self.text += rest
        return rest
