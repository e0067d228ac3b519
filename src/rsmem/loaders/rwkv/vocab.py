"""The RWKV World vocabulary file (``rwkv_vocab_v20230424.txt``: one token a line, its id, its Python
literal and its byte length) as llama.cpp's converter stores it in a GGUF file."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import gguf

from rsmem.errors import ModelFormatError
from rsmem.loaders.rwkv.tokenizer import escape_rwkv_token
from rsmem.loaders.tokenizer import TokenizerData


def world_vocabulary(vocab: str | os.PathLike[str], n_vocab: int) -> TokenizerData:
    """The World vocabulary file as llama.cpp's converter stores it (escaped token texts)."""
    tokens, types = ["<s>"], [int(gguf.TokenType.CONTROL)]
    try:
        for line in Path(vocab).read_text(encoding="utf-8").splitlines():
            parts = line.split(" ")
            token = ast.literal_eval(" ".join(parts[1:-1]))
            raw = token.encode("utf-8") if isinstance(token, str) else token
            if not isinstance(raw, bytes) or len(raw) != int(parts[-1]):
                raise ValueError(f"token {token!r} does not have its stated length {parts[-1]}")
            tokens.append(escape_rwkv_token(raw))
            types.append(int(gguf.TokenType.NORMAL))
    except (OSError, ValueError, SyntaxError) as exc:
        raise ModelFormatError(f"{vocab}: not an RWKV World vocabulary file ({exc})") from exc
    if len(tokens) > n_vocab:
        raise ModelFormatError(f"{vocab}: {len(tokens)} tokens for an embedding of {n_vocab} rows")
    for i in range(len(tokens), n_vocab):
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
    return TokenizerData(
        tokens=tokens, token_types=types, merges=[], bos_id=0, eos_id=0, model="rwkv", pre=""
    )
