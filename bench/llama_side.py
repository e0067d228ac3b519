"""llama.cpp's side of ``bench/throughput.py``: a llama-cpp-python worker process (another venv; not a
dependency of rsmem) that keeps a model loaded and answers one measurement a line, and llama.cpp's own
quantizer for ``--weights``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import rsmem.threads
from bench_arch import row_shape


def llama_environment(passive: bool = False) -> dict[str, str]:
    """The environment llama.cpp runs in: this process's, less what ``import rsmem`` put into it. rsmem sets
    ``OMP_WAIT_POLICY=PASSIVE`` for its own process before torch loads; llama.cpp (built with OpenMP here:
    libgomp too) would inherit it through ``os.environ``, and sleeping threads slow its quiet steps
    (measured: up to 1.7x at decode x64 on the embedded model). Its users run it with OpenMP's default
    (spin, then sleep), so it gets that unless ``passive`` asks for rsmem's policy."""
    env = dict(os.environ)
    if rsmem.threads.wait_policy() == "passive" and not passive:
        env.pop("OMP_WAIT_POLICY", None)
    if passive:
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    return env


# A worker: loads the model once, then answers one measurement a line ("prefill" or "decode N") on stdin.
LLAMA_WORKER = r"""
import json, sys, time
import llama_cpp as L
path, n_prompt, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
L.llama_backend_init()
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
rss_before = rss()
model = L.llama_model_load_from_file(path.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = 8192, max(n_prompt, 64), max(n_prompt, 64), 64
cp.kv_unified = True  # attention layers: one KV stream of 8192 cells, so one sequence can hold 4096+
cp.type_k = cp.type_v = 0  # GGML_TYPE_F32: attention layers' K/V in f32, as rsmem's default
cp.n_threads = cp.n_threads_batch = threads
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
batch = L.llama_batch_init(max(n_prompt, 64), 0, 1)
n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
def decode(entries):
    batch.n_tokens = len(entries)
    for i, (t, p, s, out) in enumerate(entries):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, out
        batch.seq_id[i][0] = s
    assert L.llama_decode(ctx, batch) == 0
prompt = [(7 * i) % min(50000, n_vocab - 1) + 1 for i in range(n_prompt)]
def prefill():
    L.llama_memory_clear(mem, True)
    t0 = time.perf_counter(); decode([(t, i, 0, i == n_prompt - 1) for i, t in enumerate(prompt)])
    return n_prompt / (time.perf_counter() - t0)
def decode_n(n, context):
    L.llama_memory_clear(mem, True)
    for i in range(0, context, n_prompt):  # a long context first (one sequence), in chunks of n_batch
        decode([((7 * p) % 1000 + 1, p, 0, False) for p in range(i, min(i + n_prompt, context))])
    decode([(5, context, s, True) for s in range(n)])
    decode([(6, context + 1, s, True) for s in range(n)])  # warm-up step
    t0 = time.perf_counter()
    for k in range(context + 2, context + steps + 2):
        decode([((s + k) % 1000 + 1, k, s, True) for s in range(n)])
    return n * steps / (time.perf_counter() - t0)
prefill()  # warm-up
print("ready", rss() - rss_before, flush=True)
for line in sys.stdin:
    cmd = line.split()
    out = prefill() if cmd[0] == "prefill" else decode_n(int(cmd[1]), int(cmd[2]))
    print(json.dumps(out), flush=True)
"""

# llama.cpp's quantizer (llama_model_quantize, default parameters) on one file: argv src, dst, ftype name
LLAMA_QUANTIZE = r"""
import sys
import llama_cpp as L
src, dst, name = sys.argv[1], sys.argv[2], sys.argv[3]
params = L.llama_model_quantize_default_params()
params.ftype = getattr(L, "LLAMA_FTYPE_MOSTLY_" + name.upper())
sys.exit(L.llama_model_quantize(src.encode(), dst.encode(), params))
"""


def llama_quantize(python: str, src: Path, dst: Path, ftype: str) -> Path:
    """``src`` quantized to ``ftype`` (``q8_0``, ``q4_k_m``, ...) by llama.cpp's own quantizer."""
    subprocess.run([python, "-c", LLAMA_QUANTIZE, str(src), str(dst), ftype], check=True, capture_output=True)
    return dst


# rsmem's resident memory for a model, in a fresh process: what loading it and one short prefill add
RSMEM_RESIDENT = r"""
import gc, sys
import rsmem
def rss():
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmRSS:"))
before = rss()
model = rsmem.load_model(sys.argv[1], compile="0")
ctx = rsmem.Context(model)
ctx.decode(rsmem.Batch([1] * 64, seq_ids=[[0]] * 64))
gc.collect()
print(rss() - before)
"""


def rsmem_resident(path: Path) -> int:
    """Bytes that loading ``path`` (and a 64-token prefill) adds to a fresh rsmem process."""
    out = subprocess.run([sys.executable, "-c", RSMEM_RESIDENT, str(path)], check=True, capture_output=True)
    return int(out.stdout.split()[-1])


class LlamaWorker:
    """llama.cpp's side: a llama-cpp-python process (another venv) that keeps the model loaded."""

    def __init__(
        self, python: str, path: Path, n_prompt: int, steps: int, threads: int, passive: bool = False
    ) -> None:
        args = [python, "-c", LLAMA_WORKER, str(path), str(n_prompt), str(steps), str(threads)]
        self.proc = subprocess.Popen(
            args,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=llama_environment(passive),
        )
        ready = self._line().split()
        if not ready or ready[0] != "ready":
            raise RuntimeError("llama.cpp worker did not start")
        self.resident = int(ready[1])  # what loading and one prefill added to the worker's memory

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"llama.cpp worker exited with {self.proc.wait()}")
        return line.strip()

    def measure(self, row: str) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write("prefill\n" if row == "prefill" else "decode {} {}\n".format(*row_shape(row)))
        self.proc.stdin.flush()
        return float(json.loads(self._line()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=30)
