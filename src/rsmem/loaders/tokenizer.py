"""Byte-level BPE vocabularies (GGUF ``gpt2`` model / HF ``tokenizer.json``) as ``tokenizers.Tokenizer``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from rsmem.errors import ModelFormatError


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
    )


def tokenizer_data_from_gguf(reader: gguf.GGUFReader) -> TokenizerData | None:
    """The ``gpt2`` vocabulary stored in a GGUF file's metadata, or None if it has another or none."""
    fields = reader.fields

    def value(key: str) -> object:
        f = fields.get(key)
        return None if f is None else f.contents()

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
    if model == "rwkv":  # the RWKV World vocabulary (see rsmem.loaders.rwkv_tokenizer): no merges
        return TokenizerData(
            tokens=strings("tokenizer.ggml.tokens"),
            token_types=ints("tokenizer.ggml.token_type"),
            merges=[],
            bos_id=token_id("tokenizer.ggml.bos_token_id"),
            eos_id=token_id("tokenizer.ggml.eos_token_id"),
            model="rwkv",
            pre="",
        )
    if model != "gpt2":
        return None
    return TokenizerData(
        tokens=strings("tokenizer.ggml.tokens"),
        token_types=ints("tokenizer.ggml.token_type"),
        merges=strings("tokenizer.ggml.merges"),
        bos_id=token_id("tokenizer.ggml.bos_token_id"),
        eos_id=token_id("tokenizer.ggml.eos_token_id"),
        pad_id=token_id("tokenizer.ggml.padding_token_id"),
        pre=str(value("tokenizer.ggml.pre") or "gpt-2"),
    )


def build_tokenizer(data: TokenizerData) -> Tokenizer:
    """A byte-level BPE ``tokenizers.Tokenizer`` (GPT-2 pre-tokenisation) from the stored vocabulary; for
    an ``rwkv`` vocabulary, a :class:`~rsmem.loaders.rwkv_tokenizer.RwkvTokenizer` (it offers the part of
    ``tokenizers.Tokenizer`` the engine uses: encode, decode, get_vocab_size)."""
    if data.model == "rwkv":
        from rsmem.loaders.rwkv_tokenizer import RwkvTokenizer

        return cast("Tokenizer", RwkvTokenizer.from_gguf(data.tokens, data.token_types))
    vocab = {tok: i for i, tok in enumerate(data.tokens)}
    try:
        merges = [(left, right) for left, right in (m.split(" ", 1) for m in data.merges)]
    except ValueError as exc:  # a merge without its space
        raise ModelFormatError(f"a BPE merge is not two tokens ({exc})") from exc
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
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
