"""Make the ARWKV-7 and QRWKV-6 llama.cpp fixtures of this folder (run by hand; not a test).

    .venv/bin/python scripts/make_rwkv_variant_fixtures.py /path/to/venv/bin/python

The argument is a Python with ``llama-cpp-python==0.3.36`` (llama.cpp b11312) and numpy. For ``arwkv7``
(gate and WKV output norm), ``arwkv7-nogate`` (five lerps, neither), ``rwkv6qwen2`` (two key/value heads)
and ``rwkv6qwen2-gqa`` (one key/value head for two heads, receptance/key/value biases): the random GGUF of
``tests/helpers/rwkv_variants.py`` (its sha256 is recorded, so the tests rebuild the same file instead of
shipping it), run by llama.cpp on CPU, one thread: every prompt token's logits, the sequence's state blob
after it, then three tokens one by one, and two sequences (a copy of sequence 0, and sequence 0) each given
a token in one batch.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "llamacpp" / "rwkv"
sys.path.insert(0, str(ROOT / "tests"))  # tests/helpers
from helpers.rwkv_variants import random_arwkv7_gguf, random_rwkv6qwen2_gguf, sha256  # noqa: E402

PROMPT = [5, 72, 101, 108, 108, 111, 44, 33, 258, 290, 17, 3]
CONTINUATION = [9, 120, 299]
PAIR = [11, 77]  # sequence 0 and its copy, sequence 1, each one token in one batch

WORKER = r"""
import ctypes, json, sys
import numpy as np
import llama_cpp as L
path, out = sys.argv[1], sys.argv[2]
spec = json.loads(sys.argv[3])
L.llama_backend_init()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
assert model
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = 512, 512, 512, 2, 1, 1
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
def decode(tokens, seqs, pos):
    batch = L.llama_batch_init(len(tokens), 0, 2)
    batch.n_tokens = len(tokens)
    for i, (t, s, p) in enumerate(zip(tokens, seqs, pos)):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, True
        batch.seq_id[i][0] = s
    assert L.llama_decode(ctx, batch) == 0
    rows = [np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(n_vocab,)).copy()
            for i in range(len(tokens))]
    L.llama_batch_free(batch)
    return np.stack(rows)
prompt = spec["prompt"]
np.save(out + "/logits-prompt.npy", decode(prompt, [0] * len(prompt), list(range(len(prompt)))))
size = L.llama_state_seq_get_size(ctx, 0)
buf = (ctypes.c_uint8 * size)()
assert L.llama_state_seq_get_data(ctx, buf, size, 0) == size
open(out + "/state-seq0.bin", "wb").write(bytes(buf))
n = len(prompt)
rows = []
for i, t in enumerate(spec["continuation"]):
    rows.append(decode([t], [0], [n + i])[0])
np.save(out + "/logits-continuation.npy", np.stack(rows))
n += len(spec["continuation"])
L.llama_memory_seq_cp(mem, 0, 1, -1, -1)
np.save(out + "/logits-pair.npy", decode(spec["pair"], [0, 1], [n, n]))
"""


def main(llama_python: str) -> None:
    variants: dict[str, Callable[[Path], Path]] = {
        "arwkv7": lambda p: random_arwkv7_gguf(p, gated=True, seed=3),
        "arwkv7-nogate": lambda p: random_arwkv7_gguf(p, gated=False, seed=3),
        "rwkv6qwen2": lambda p: random_rwkv6qwen2_gguf(p, gqa=False, seed=4),
        "rwkv6qwen2-gqa": lambda p: random_rwkv6qwen2_gguf(p, gqa=True, seed=4),
    }
    for name, build in variants.items():
        out = OUT / name
        out.mkdir(exist_ok=True)
        spec: dict[str, object] = {"prompt": PROMPT, "continuation": CONTINUATION, "pair": PAIR}
        with tempfile.TemporaryDirectory() as tmp:
            gguf_path = build(Path(tmp) / "model-f32.gguf")
            args = [llama_python, "-c", WORKER, str(gguf_path), str(out), json.dumps(spec)]
            subprocess.run(args, check=True)
            spec["gguf_sha256"] = sha256(gguf_path)
        (out / "fixture.json").write_text(json.dumps(spec, indent=1) + "\n")
        print(f"{name}: {sorted(p.name for p in out.iterdir())}")


if __name__ == "__main__":
    main(sys.argv[1])
