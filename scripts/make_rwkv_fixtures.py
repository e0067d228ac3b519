"""Make the RWKV-6/7 llama.cpp fixtures of this folder (run by hand; not a test).

    LD_LIBRARY_PATH=$LIB LLAMA_CPP_LIB_PATH=$LIB LLAMA_CPP_PY=/path/to/llama_cpp_python-0.3.36 \\
        .venv/bin/python scripts/make_rwkv_fixtures.py

``$LIB`` holds ``libllama.so`` of llama.cpp b11312 (the build inside llama-cpp-python 0.3.36, e.g. the one
``bench/llamaserver_build.py`` makes); the bindings are that sdist's ``llama_cpp/llama_cpp.py`` (ctypes),
imported without the package's ``__init__``. For each of rwkv7 and rwkv6: a random BlinkDL checkpoint
(``tests/helpers/rwkv_reference.py``, n_embd 128, 2 layers, d_ff 128, head size 64, 300 tokens), converted by
rsmem's ``convert_blink_to_gguf`` with the first 299 tokens of the World vocabulary (the ``rwkv``
package's file), then run by llama.cpp on CPU: the prompt's logits, the sequence state blob after it, four
continuation tokens one by one, and a fork (``seq_cp`` 0 -> 1, then two tokens on each in one batch).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "llamacpp" / "rwkv"
sys.path.insert(0, str(ROOT / "tests"))  # tests/helpers: the random checkpoints

pkg = types.ModuleType("llama_cpp")
pkg.__path__ = [str(Path(os.environ["LLAMA_CPP_PY"]) / "llama_cpp")]
sys.modules["llama_cpp"] = pkg
import llama_cpp.llama_cpp as L  # noqa: E402
import rwkv  # noqa: E402

from helpers.rwkv_reference import random_rwkv6, random_rwkv7  # noqa: E402
from rsmem.loaders.rwkv.convert import convert_blink_to_gguf  # noqa: E402

TEXTS = [
    "Hello, world!\n\n  (1 + 2) = 3; x",
    "\tTabs\t\tand\r\nlines ' \" \\ @",
    "caf\u00e9 \u4f60\u597d \U0001f600",
]
CONTINUATION = [261, 72, 268, 290]
FORK = {0: [300 - 1, 5], 1: [11, 267]}


def tokenize(vocab, text: str) -> list[int]:
    raw = text.encode()
    buf = (L.llama_token * (4 * len(raw) + 8))()
    n = L.llama_tokenize(vocab, raw, len(raw), buf, len(buf), False, False)
    assert n >= 0
    return list(buf[:n])


def decode(
    ctx, tokens: list[int], seqs: list[int], pos: list[int], logits: list[bool], n_vocab: int
) -> np.ndarray:
    batch = L.llama_batch_init(len(tokens), 0, 2)
    batch.n_tokens = len(tokens)
    for i, (t, s, p, out) in enumerate(zip(tokens, seqs, pos, logits)):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, out
        batch.seq_id[i][0] = s
    assert L.llama_decode(ctx, batch) == 0
    rows = [
        np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
        for i, o in enumerate(logits)
        if o
    ]
    L.llama_batch_free(batch)
    return np.stack(rows)


def make(arch: str) -> None:
    out = OUT / arch
    out.mkdir(exist_ok=True)
    sd = (random_rwkv7 if arch == "rwkv7" else random_rwkv6)(128, 2, 300, seed=11, d_ff=128)
    with tempfile.TemporaryDirectory() as tmp:
        pth, vocab = Path(tmp) / "model.pth", Path(tmp) / "vocab.txt"
        torch.save(sd, pth)
        lines = (
            (Path(rwkv.__file__).parent / "rwkv_vocab_v20230424.txt").read_text(encoding="utf-8").splitlines()
        )
        vocab.write_text("\n".join(lines[:299]) + "\n", encoding="utf-8")
        convert_blink_to_gguf(pth, out / "model-f32.gguf", vocab=vocab)
    model = L.llama_model_load_from_file(str(out / "model-f32.gguf").encode(), L.llama_model_default_params())
    vocab_ = L.llama_model_get_vocab(model)
    n_vocab = L.llama_vocab_n_tokens(vocab_)
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 512, 512, 512, 2, 2, 2
    ctx = L.llama_init_from_model(model, cp)
    tokenized = {t: tokenize(vocab_, t) for t in TEXTS}
    prompt = tokenized[TEXTS[0]]
    n = len(prompt)
    np.save(out / "logits-prompt.npy", decode(ctx, prompt, [0] * n, list(range(n)), [True] * n, n_vocab))
    size = L.llama_state_seq_get_size(ctx, 0)
    buf = (ctypes.c_uint8 * size)()
    assert L.llama_state_seq_get_data(ctx, buf, size, 0) == size
    (out / "state-seq0.bin").write_bytes(bytes(buf))
    cont = [decode(ctx, [t], [0], [n + i], [True], n_vocab)[0] for i, t in enumerate(CONTINUATION)]
    np.save(out / "logits-continuation.npy", np.stack(cont))
    mem = L.llama_get_memory(ctx)
    L.llama_memory_seq_cp(mem, 0, 1, -1, -1)
    p0 = n + len(CONTINUATION)
    toks = FORK[0] + FORK[1]
    fork = decode(ctx, toks, [0, 0, 1, 1], [p0, p0 + 1, p0, p0 + 1], [False, True, False, True], n_vocab)
    np.save(out / "logits-fork.npy", fork)
    (out / "fixture.json").write_text(
        json.dumps(
            {
                "arch": arch,
                "llama.cpp": "b11312 (llama-cpp-python 0.3.36), CPU, n_ctx 512, n_batch = n_ubatch 512, "
                "n_seq_max 2",
                "texts": TEXTS,
                "tokens": [tokenized[t] for t in TEXTS],
                "prompt": prompt,
                "continuation": CONTINUATION,
                "fork": {str(k): v for k, v in FORK.items()},
                "state_blob_bytes": size,
            },
            indent=1,
        )
        + "\n"
    )
    L.llama_free(ctx)
    L.llama_model_free(model)


if __name__ == "__main__":
    L.llama_backend_init()
    for arch in ("rwkv7", "rwkv6"):
        make(arch)
