"""The decode step of one or a few sequences: the C++ step (``rsmem_native::mamba_step`` /
``mamba2_step``) against the compiled step, in one process, in interleaved rounds.

``RSMEM_NATIVE_STEP`` is read at every step, so each round times ``--steps`` steps with the C++ step, then
as many with the compiled one (``--compile 0``: the eager layer-by-layer forward), on the same model and
context. Prints ms a step per file and side (median of the rounds, with their range) and the ratio
compiled / C++ (the C++ step's speed-up: median of per-round ratios, with their range).

    python bench/native_step.py FILE.gguf [FILE.gguf ...] --rounds 7 --threads 2 --seqs 1 8
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from typing import Any

import rsmem  # before torch: rsmem's OpenMP wait policy


def step_ms(ctx: rsmem.Context, steps: int, start: int, n_seqs: int) -> float:
    times = []
    seq_ids = [[s] for s in range(n_seqs)]
    for k in range(steps):
        tokens = [(start + k + 7 * s) % 1000 + 1 for s in range(n_seqs)]
        t0 = time.perf_counter()
        ctx.decode(rsmem.Batch(tokens, seq_ids=seq_ids, logits=[True] * n_seqs))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", default="1", help="the other side: 1 the compiled step, 0 the eager forward")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1], help="sequences a step (rows of the table)")
    args = ap.parse_args()
    print(f"{args.threads} threads, {args.rounds} rounds of {args.steps} steps a side")
    print(f"{'file':<32} {'seqs':>4} {'C++ ms':>18} {'other ms':>18} {'other/C++':>10} {'(range)':>12}")
    for path in args.files:
        model = rsmem.load_model(path, compile=args.compile, n_threads=args.threads)
        for n_seqs in args.seqs:
            measure(model, path, n_seqs, args)


def measure(model: Any, path: str, n_seqs: int, args: argparse.Namespace) -> None:
    ctx = rsmem.Context(model, n_seq_max=n_seqs)
    for s in range(n_seqs):
        ctx.decode(rsmem.Batch(list(range(1 + s, 33 + s)), seq_ids=[[s]] * 32))
    native, other = [], []
    for side in ("1", "0"):  # warm both (the compiled step compiles at its first call)
        os.environ["RSMEM_NATIVE_STEP"] = side
        step_ms(ctx, 3, 0, n_seqs)
    for r in range(args.rounds):
        os.environ["RSMEM_NATIVE_STEP"] = "1"
        native.append(step_ms(ctx, args.steps, 100 * r, n_seqs))
        os.environ["RSMEM_NATIVE_STEP"] = "0"
        other.append(step_ms(ctx, args.steps, 100 * r + 50, n_seqs))
    os.environ.pop("RSMEM_NATIVE_STEP")
    ratios = [o / n for o, n in zip(other, native, strict=True)]

    def cell(v: list[float]) -> str:
        return f"{statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f})"

    name = os.path.basename(path)
    print(
        f"{name:<32} {n_seqs:>4} {cell(native):>18} {cell(other):>18} {statistics.median(ratios):>10.2f} "
        f"{min(ratios):>6.2f}-{max(ratios):.2f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
