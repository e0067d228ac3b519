"""rsmem against llama.cpp b11312 on the same RWKV GGUF, interleaved in one process (run by hand; not a test).

    LD_LIBRARY_PATH=$LIB LLAMA_CPP_LIB_PATH=$LIB LLAMA_CPP_PY=/path/to/llama_cpp_python-0.3.36 \\
        .venv/bin/python scripts/bench_rwkv_vs_llamacpp.py MODEL.gguf

One thread each; three rounds alternate llama.cpp and rsmem (compiled one-sequence steps): a 512-token
prefill, then 5 decode steps of 1, 8 and 64 sequences; medians in tokens per second. Alternating in one
process is what made the comparison usable on the shared 2-core machine (separate runs varied 2x).
A 130M-class model: ``convert_blink_to_gguf`` of ``random_rwkv7(768, 12, 65536)``
(tests/helpers/rwkv_reference.py).
"""

from __future__ import annotations

import os
import sys
import time
import types
from pathlib import Path

import torch

pkg = types.ModuleType("llama_cpp")
pkg.__path__ = [str(Path(os.environ["LLAMA_CPP_PY"]) / "llama_cpp")]
sys.modules["llama_cpp"] = pkg
import llama_cpp.llama_cpp as L  # noqa: E402

import rsmem  # noqa: E402
from rsmem import Batch, Context  # noqa: E402

STEPS = 5


def llama_decode(ctx: object, tokens: list[int], seqs: list[int], pos: list[int]) -> None:
    batch = L.llama_batch_init(len(tokens), 0, 1)
    batch.n_tokens = len(tokens)
    for i, (t, s, p) in enumerate(zip(tokens, seqs, pos)):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, True
        batch.seq_id[i][0] = s
    assert L.llama_decode(ctx, batch) == 0
    L.llama_batch_free(batch)


def main(path: str) -> None:
    torch.set_num_threads(1)
    L.llama_backend_init()
    model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max, cp.n_threads, cp.n_threads_batch = (
        4096,
        512,
        512,
        64,
        1,
        1,
    )
    lctx = L.llama_init_from_model(model, cp)
    mem = L.llama_get_memory(lctx)
    ours = rsmem.load_model(path, compile=True)
    ours.warm_up()
    prompt = list(range(512))
    rates: dict[str, list[float]] = {}

    def record(name: str, n_tokens: int, started: float) -> None:
        rates.setdefault(name, []).append(n_tokens / (time.perf_counter() - started))

    for _ in range(3):
        L.llama_memory_clear(mem, True)
        started = time.perf_counter()
        llama_decode(lctx, prompt, [0] * 512, list(range(512)))
        record("llama.cpp prefill 512", 512, started)
        started = time.perf_counter()
        Context(ours, n_seq_max=64).decode(Batch(prompt))
        record("rsmem prefill 512", 512, started)
        for n in (1, 8, 64):
            seqs = list(range(n))
            L.llama_memory_clear(mem, True)
            llama_decode(lctx, seqs, seqs, [0] * n)
            started = time.perf_counter()
            for step in range(STEPS):
                llama_decode(lctx, seqs, seqs, [step + 1] * n)
            record(f"llama.cpp decode x{n}", n * STEPS, started)
            ctx = Context(ours, n_seq_max=64)
            batch = Batch(seqs, seq_ids=[[s] for s in seqs], logits=[True] * n)
            ctx.decode(batch)
            started = time.perf_counter()
            for _step in range(STEPS):
                ctx.decode(batch)
            record(f"rsmem decode x{n}", n * STEPS, started)
    for name, values in rates.items():
        print(f"{name}: median {sorted(values)[len(values) // 2]:.1f} tok/s")


if __name__ == "__main__":
    main(sys.argv[1])
