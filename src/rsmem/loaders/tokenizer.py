"""Byte-level BPE vocabularies (GGUF ``gpt2`` model / HF ``tokenizer.json``) as ``tokenizers.Tokenizer``."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from rsmem.errors import ModelFormatError
from rsmem.loaders.hparams import field_contents

log = logging.getLogger("rsmem.loaders")
MERGES = "tokenizer.ggml.merges"


@dataclass(slots=True)
class TokenizerData:
    """What GGUF's ``tokenizer.ggml.*`` keys hold for a ``gpt2`` vocabulary."""

    tokens: list[str]
    token_types: list[int]  # gguf.TokenType: 1 normal, 3 control, 4 user-defined, 5 unused
    merges: list[str]  # "left right"
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    model: str = "gpt2"
    pre: str = "gpt-2"
    source: str = ""  # the file it was read from, for error messages

    def where(self) -> str:
        """``"{source}: "`` to start an error message, or nothing."""
        return f"{self.source}: " if self.source else ""

    def padded(self, n_vocab: int) -> TokenizerData:
        """The vocabulary padded with ``[PAD{i}]`` tokens up to ``n_vocab``, as llama.cpp's converter does."""
        extra = range(len(self.tokens), n_vocab)
        return TokenizerData(
            tokens=self.tokens + [f"[PAD{i}]" for i in extra],
            token_types=self.token_types + [int(gguf.TokenType.UNUSED)] * len(extra),
            merges=self.merges,
            bos_id=self.bos_id,
            eos_id=self.eos_id,
            pad_id=self.pad_id,
            model=self.model,
            pre=self.pre,
            source=self.source,
        )


def tokenizer_data_from_hf(folder: Path, config: dict) -> TokenizerData | None:
    """Read ``tokenizer.json`` of an HF folder (None when it has none); ids of unused slots become pads."""
    path = folder / "tokenizer.json"
    if not path.exists():
        return None
    try:
        spec = json.loads(path.read_text(encoding="utf-8"))
        model = spec["model"]
        if model.get("type") != "BPE":
            return None
        by_id: dict[int, str] = {int(i): tok for tok, i in model["vocab"].items()}
        added = {int(t["id"]): t for t in spec.get("added_tokens", [])}
        for i, t in added.items():
            by_id[i] = t["content"]
        merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFormatError(f"{path}: unreadable tokenizer.json ({exc})") from exc
    n = max(by_id) + 1 if by_id else 0
    tokens, types = [], []
    for i in range(n):
        if i not in by_id:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            special = added[i].get("special", False)
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(by_id[i])
            types.append(int(gguf.TokenType.NORMAL))
    return TokenizerData(
        tokens=tokens,
        token_types=types,
        merges=merges,
        bos_id=config.get("bos_token_id"),
        eos_id=config.get("eos_token_id"),
        pad_id=config.get("pad_token_id"),
        source=str(path),
    )


def tokenizer_data_from_gguf(reader: gguf.GGUFReader, n_vocab: int | None = None) -> TokenizerData | None:
    """The ``gpt2`` vocabulary stored in a GGUF file's metadata, or None if it has another or none.

    ``n_vocab``: the embedding's rows, when known. The vocabulary is checked: no more tokens than the
    embedding has rows, one type per token, BOS and EOS ids naming tokens (a padding id that names none is
    dropped with a warning, as llama.cpp drops it: rsmem never uses it)."""
    fields = reader.fields

    def value(key: str) -> object:
        f = fields.get(key)
        return None if f is None else field_contents(f, key)

    def strings(key: str) -> list[str]:
        v = value(key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
            raise ModelFormatError(f"GGUF metadata key {key!r} is not a list of strings")
        return v

    def ints(key: str) -> list[int]:
        v = value(key)
        if v is None:
            return []
        if not isinstance(v, list) or not all(isinstance(x, int) for x in v):
            raise ModelFormatError(f"GGUF metadata key {key!r} is not a list of integers")
        return v

    def token_id(key: str) -> int | None:
        v = value(key)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise ModelFormatError(f"GGUF metadata key {key!r} is {v!r}, not a token id")
        return v

    model = value("tokenizer.ggml.model")
    if model == "rwkv":  # the RWKV World vocabulary (see rsmem.loaders.rwkv.tokenizer): no merges
        data = TokenizerData(
            tokens=strings("tokenizer.ggml.tokens"),
            token_types=ints("tokenizer.ggml.token_type"),
            merges=[],
            bos_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_id=token_id("tokenizer.ggml.eos_token_id"),
            model="rwkv",
            pre="",
        )
    elif model == "gpt2":
        data = TokenizerData(
            tokens=strings("tokenizer.ggml.tokens"),
            token_types=ints("tokenizer.ggml.token_type"),
            merges=strings("tokenizer.ggml.merges"),
            bos_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_id=token_id("tokenizer.ggml.eos_token_id"),
            pad_id=token_id("tokenizer.ggml.padding_token_id"),
            pre=str(value("tokenizer.ggml.pre") or "gpt-2"),
        )
    else:
        return None
    _check_vocabulary(data, n_vocab)
    return data


def _check_vocabulary(data: TokenizerData, n_vocab: int | None) -> None:
    n = len(data.tokens)
    if n_vocab is not None and n > n_vocab:
        raise ModelFormatError(
            f"GGUF metadata key 'tokenizer.ggml.tokens' has {n} tokens, more than the {n_vocab} rows of "
            "the embedding (token_embd.weight)"
        )
    if data.token_types and len(data.token_types) != n:
        raise ModelFormatError(
            f"GGUF metadata key 'tokenizer.ggml.token_type' has {len(data.token_types)} entries for "
            f"{n} tokens"
        )
    for key, token in (("bos_token_id", data.bos_id), ("eos_token_id", data.eos_id)):
        if token is not None and not 0 <= token < n:
            raise ModelFormatError(
                f"GGUF metadata key 'tokenizer.ggml.{key}' is {token}, outside the vocabulary [0, {n})"
            )
    if data.pad_id is not None and not 0 <= data.pad_id < n:
        log.warning("tokenizer.ggml.padding_token_id %d names no token (%d tokens): ignored", data.pad_id, n)
        data.pad_id = None


def build_tokenizer(data: TokenizerData) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2 pre-tokenisation) from the stored vocabulary; for
    an ``rwkv`` vocabulary, a :class:`~rsmem.loaders.rwkv.tokenizer.RwkvTokenizer` (it offers the part of
    ``tokenizers.Tokenizer`` the engine uses: encode, decode, get_vocab_size)."""
    if data.model == "rwkv":
        from rsmem.loaders.rwkv.tokenizer import RwkvTokenizer

        return cast("Tokenizer", RwkvTokenizer.from_gguf(data.tokens, data.token_types))
    vocab = {tok: i for i, tok in enumerate(data.tokens)}
    merges = []
    for i, m in enumerate(data.merges):
        left, space, right = m.partition(" ")
        if not space:
            raise ModelFormatError(f"{data.where()}BPE merge {i} ({m!r}) of {MERGES!r} is not two tokens")
        merges.append((left, right))
    try:
        model = models.BPE(vocab=vocab, merges=merges, fuse_unk=False)
    except Exception as exc:  # tokenizers raises a plain Exception for merges it cannot use
        raise ModelFormatError(f"{data.where()}{_bad_merge(merges, vocab) or exc}") from exc
    tok = Tokenizer(model)
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    special = [
        AddedToken(t, special=True, normalized=False)
        for t, ty in zip(data.tokens, data.token_types)
        if ty == gguf.TokenType.CONTROL
    ]
    if special:
        tok.add_special_tokens(special)
    return tok


def _bad_merge(merges: list[tuple[str, str]], vocab: dict[str, int]) -> str | None:
    """What is wrong with the first merge a BPE model cannot use: each side and their concatenation must be
    tokens of the vocabulary."""
    for i, (left, right) in enumerate(merges):
        for part in (left, right, left + right):
            if part not in vocab:
                return (
                    f"BPE merge {i} ({left + ' ' + right!r}) of {MERGES!r} needs {part!r}, which is not "
                    "in the vocabulary ('tokenizer.ggml.tokens')"
                )
    return None
