"""RWKV-6 and RWKV-7 for ``bench/throughput.py`` (``--arch rwkv6``, ``--arch rwkv7``).

A random 130M-class BlinkDL checkpoint (n_embd 768, 12 layers, head size 64, vocab 65536: the shape of
BlinkDL's 0.1B models, whose layers each hold a time mix and a channel mix;
``tests/helpers/rwkv_reference.py`` makes it) is converted to an f32 GGUF by rsmem's ``convert_blink_to_gguf``
with a byte vocabulary (llama.cpp refuses a GGUF without one); rsmem and llama.cpp then run that file. The
third column is the official ``rwkv`` package (0.8.32, a test extra) on the same ``.pth``, strategy ``cpu
fp32`` with its TorchScript kernels (``RWKV_JIT_ON=1``; RWKV-7 through ``RWKV_x070``, ``RWKV_V7_ON=1``), in a
subprocess with the same thread count, ``--rounds`` measurements of each row and their median. The package has
no batch: decode xN runs N states one token at a time (``forward`` on one token each), so its xN rows are its
x1 speed again.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from bench_arch import BenchArch

ROOT = Path(__file__).resolve().parents[1]
N_EMBD, N_LAYER, N_VOCAB, HEAD_SIZE = 768, 12, 65536, 64

# Measures the rwkv package on one .pth: argv = model path (no suffix), version, prompt, steps, threads,
# rounds, rows...; prints {row: median tokens/s}.
RWKV_WORKER = r"""
import json, os, statistics, sys, time
path, version, n_prompt, steps, threads, rounds = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
rows = sys.argv[7:]
import torch
torch.set_num_threads(threads)
import rwkv.model as M
model = M.RWKV_x070(path, "cpu fp32") if version == "7" else M.RWKV(path, strategy="cpu fp32")
prompt = [(7 * i) % 50000 + 1 for i in range(n_prompt)]
def prefill():
    t0 = time.perf_counter(); model.forward(prompt, None)
    return n_prompt / (time.perf_counter() - t0)
def decode(n):
    states = [model.forward([5], None)[1] for _ in range(n)]
    for s in range(n):
        states[s] = model.forward([6], states[s])[1]  # warm-up step
    k_steps = max(2, min(steps, 128 // n))  # the package runs xN as N x1 steps: fewer steps at large N
    t0 = time.perf_counter()
    for k in range(2, k_steps + 2):
        for s in range(n):
            states[s] = model.forward([(s + k) % 1000 + 1], states[s])[1]
    return n * k_steps / (time.perf_counter() - t0)
prefill()  # warm-up (TorchScript specialises on the first calls)
got = {row: [] for row in rows}
for _ in range(rounds):
    for row in rows:
        got[row].append(prefill() if row == "prefill" else decode(int(row[6:])))
print(json.dumps({row: statistics.median(v) for row, v in got.items()}))
"""


def write_byte_vocab(path: Path) -> Path:
    """A World vocabulary file of the 256 single bytes (``id repr(bytes) length`` lines); the converter
    pads it to the embedding's rows."""
    path.write_text("".join(f"{b + 1} {bytes([b])!r} 1\n" for b in range(256)), encoding="utf-8")
    return path


def make_build(version: int) -> Callable[[Path], Path]:
    def build(folder: Path) -> Path:
        sys.path.insert(0, str(ROOT / "tests"))
        try:
            from helpers.rwkv_reference import random_rwkv6, random_rwkv7
        finally:
            sys.path.remove(str(ROOT / "tests"))
        from rsmem.loaders.rwkv.convert import convert_blink_to_gguf

        make = random_rwkv7 if version == 7 else random_rwkv6
        pth = folder / "model.pth"
        torch.save(make(N_EMBD, N_LAYER, N_VOCAB, HEAD_SIZE, seed=0), pth)
        vocab = write_byte_vocab(folder / "vocab.txt")
        return convert_blink_to_gguf(pth, folder / "model-f32.gguf", "f32", vocab)

    return build


def make_columns(version: int) -> Callable[[Path, argparse.Namespace], dict[str, dict[str, float]]]:
    def columns(gguf_path: Path, args: argparse.Namespace) -> dict[str, dict[str, float]]:
        """The rwkv package's column, on the ``.pth`` beside the GGUF; none when the package is missing."""
        env = dict(os.environ, RWKV_JIT_ON="1", RWKV_CUDA_ON="0", RWKV_V7_ON="1" if version == 7 else "0")
        argv = [str(gguf_path.parent / "model"), str(version), str(args.prompt), str(args.steps)]
        rows = [r for r in args.rows if r == "prefill" or (r.startswith("decode") and r[6:].isdigit())]
        argv += [str(args.threads), str(args.rounds), *rows]
        proc = subprocess.run(
            [sys.executable, "-c", RWKV_WORKER, *argv], env=env, capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            print(f"rwkv package column skipped: {proc.stderr.strip().splitlines()[-1:]}")
            return {}
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        print("rwkv package 0.8.32 (cpu fp32), tokens/s:", {k: round(v, 1) for k, v in got.items()})
        return {"rwkv pkg": got}

    return columns


ARCHS: dict[str, BenchArch] = {
    "rwkv6": BenchArch(build=make_build(6), columns=make_columns(6)),
    "rwkv7": BenchArch(build=make_build(7), columns=make_columns(7)),
}
