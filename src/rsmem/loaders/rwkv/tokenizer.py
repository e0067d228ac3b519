"""The RWKV "World" tokenizer as llama.cpp stores it in GGUF (``tokenizer.ggml.model = "rwkv"``).

Each token is a byte string, stored as the text ``repr(bytes)[2:-1]`` (llama.cpp's converter:
``\\xNN``, ``\\t``, ``\\n``, ``\\r``, ``\\\\``, ``\\'`` escapes, everything else printable ASCII); token 0 is
``<s>`` (control), ids past the vocabulary file are ``[PADn]`` (unused). Text is encoded as UTF-8 and cut
greedily, left to right, into the longest byte string of the vocabulary at each position (llama.cpp's
``llm_tokenizer_rwkv`` and the ``rwkv`` package's ``TRIE_TOKENIZER`` do the same). Every single byte is a
token of the World vocabulary, so any text encodes, and decoding joins the bytes.

One deliberate difference from llama.cpp: control tokens (``<s>``) are not matched inside text (llama.cpp's
trie holds them, so the literal text ``<s>`` became token 0), which keeps ``decode(encode(text)) == text``.

:class:`RwkvTokenizer` offers the part of ``tokenizers.Tokenizer`` the engine uses: ``encode(text,
add_special_tokens=False)`` (``.ids``, ``.offsets`` in characters), ``decode(ids, skip_special_tokens=)``
and ``get_vocab_size()``.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

CONTROL = 3  # gguf.TokenType.CONTROL


def escape_rwkv_token(token: bytes) -> str:
    """The text llama.cpp's converter stores for a token: ``repr(token)[2:-1]``."""
    return repr(token)[2:-1]


def unescape_rwkv_token(text: str) -> bytes:
    """The bytes of a stored token (llama.cpp's ``llama_unescape_rwkv_token``): ``\\t \\n \\r \\xNN``, and a
    backslash before any other character keeps that character."""
    out = bytearray()
    raw = text.encode("utf-8")
    i = 0
    while i < len(raw):
        c = raw[i]
        if c != 0x5C or i + 1 == len(raw):  # not a backslash (a trailing one is kept as is)
            out.append(c)
            i += 1
            continue
        e = raw[i + 1]
        if e == ord("x"):
            out.append(int(raw[i + 2 : i + 4], 16))
            i += 4
            continue
        out.append({ord("t"): 9, ord("n"): 10, ord("r"): 13}.get(e, e))
        i += 2
    return bytes(out)


@dataclass(frozen=True, slots=True)
class RwkvEncoding:
    """What ``tokenizers.Encoding`` offers the engine: token ids and each token's character span."""

    ids: list[int]
    offsets: list[tuple[int, int]]


class RwkvTokenizer:
    """Greedy longest-match tokenizer over byte strings (a trie of the vocabulary)."""

    def __init__(self, tokens: Sequence[bytes], token_types: Sequence[int] | None = None) -> None:
        """``tokens[i]``: the bytes of token ``i``; ``token_types`` as GGUF's (3: control, never matched)."""
        self.tokens = list(tokens)
        types = list(token_types) if token_types is not None else [1] * len(self.tokens)
        self.special = {i for i, ty in enumerate(types) if ty == CONTROL}
        self._children: list[dict[int, int]] = [{}]  # trie nodes: byte -> node
        self._value: list[int] = [-1]  # the token ending at a node, -1 for none
        for i, tok in enumerate(self.tokens):
            if tok and i not in self.special:
                self._insert(tok, i)

    @classmethod
    def from_gguf(cls, texts: Sequence[str], token_types: Sequence[int] | None = None) -> RwkvTokenizer:
        """From ``tokenizer.ggml.tokens`` as llama.cpp's converter writes them (escaped)."""
        return cls([unescape_rwkv_token(t) for t in texts], token_types)

    def _insert(self, token: bytes, value: int) -> None:
        node = 0
        for byte in token:
            nxt = self._children[node].get(byte)
            if nxt is None:
                nxt = len(self._children)
                self._children[node][byte] = nxt
                self._children.append({})
                self._value.append(-1)
            node = nxt
        self._value[node] = value  # a later duplicate wins, as in llama.cpp's trie

    def encode_bytes(self, data: bytes) -> tuple[list[int], list[int]]:
        """Token ids of ``data`` and the byte offset where each ends."""
        ids: list[int] = []
        ends: list[int] = []
        children, value = self._children, self._value
        pos, n = 0, len(data)
        while pos < n:
            node, best, best_end = 0, -1, pos
            i = pos
            while i < n:
                node_next = children[node].get(data[i])
                if node_next is None:
                    break
                node = node_next
                i += 1
                if value[node] >= 0:
                    best, best_end = value[node], i
            if best < 0:
                raise ValueError(f"byte {data[pos]:#04x} at offset {pos} is not in the RWKV vocabulary")
            ids.append(best)
            ends.append(best_end)
            pos = best_end
        return ids, ends

    def encode(self, text: str, add_special_tokens: bool = False) -> RwkvEncoding:
        """``text`` as tokens, with each token's span in characters (a token that ends inside a character
        ends, in characters, before it)."""
        data = text.encode("utf-8")
        ids, byte_ends = self.encode_bytes(data)
        char_ends = []  # byte offset where each character ends
        total = 0
        for ch in text:
            total += len(ch.encode("utf-8"))
            char_ends.append(total)
        ends = [bisect.bisect_right(char_ends, e) for e in byte_ends]
        starts = [0, *ends[:-1]]
        return RwkvEncoding(ids, list(zip(starts, ends)))

    def decode_bytes(self, ids: Sequence[int], skip_special_tokens: bool = True) -> bytes:
        return b"".join(self.tokens[i] for i in ids if not (skip_special_tokens and i in self.special))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The tokens' bytes as text; a cut UTF-8 sequence becomes U+FFFD."""
        return self.decode_bytes(ids, skip_special_tokens).decode("utf-8", errors="replace")

    def get_vocab_size(self) -> int:
        return len(self.tokens)

    def id_to_token(self, token: int) -> str:
        return escape_rwkv_token(self.tokens[token])
