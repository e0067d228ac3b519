"""rsmem's product workers and their wait (``kernels/csrc/pool.h``): ms a step, interleaved, quiet and busy.

One process loads the model (rows run through ``Context.decode``, as ``bench/threads.py``) and switches the
products' threading between steps with ``torch.ops.rsmem_native.set_pool``: ``omp`` hands every range to
torch's OpenMP threads (sleeping at once: ``import rsmem``'s passive policy; the previous release),
``sleep`` uses rsmem's workers sleeping at once, ``spinN`` lets them spin N microseconds, yielding the core
to any other runnable thread, before they sleep. ``--modes busy`` rounds run one CPU-bound process beside
(a neighbour that wants a core). Each round measures every policy once per row, in a shuffled order.

    python bench/pool_spin.py --model mamba2_130m --rounds 5
    python bench/pool_spin.py --gguf lfm2-f32.gguf --rows decode1 decode8 --policies omp spin200
"""

from __future__ import annotations

import argparse
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

# isort: off
import rsmem  # first: it sets OpenMP's wait policy, which libgomp reads when torch loads (rsmem.threads)
import torch

# isort: on
from rsmem import Batch, Context
from rsmem.kernels.build import native_ops

POLICIES = {"omp": -1, "sleep": 0, "spin50": 50, "spin200": 200, "spin1000": 1000}


def load(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    if args.gguf:
        return rsmem.load_model(args.gguf)
    from rsmem.models.mamba import random_init

    model = getattr(random_init, args.model)()
    model.set_compile(True)
    return model


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="mamba2_130m", help="a rsmem.models.mamba.random_init builder")
    ap.add_argument("--gguf", type=Path, default=None, help="a GGUF file instead of --model")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=8, help="decode steps a measurement")
    ap.add_argument("--rows", nargs="+", default=["decode1", "decode8"])
    ap.add_argument("--modes", nargs="+", choices=["busy", "quiet"], default=["quiet", "busy"])
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=["omp", "sleep", "spin200"])
    args = ap.parse_args()
    ops = native_ops()
    if ops is None:
        sys.exit("the C++ kernels are needed")
    model = load(args)
    rsmem.threads.use_threads(model)
    prompt = torch.randint(0, model.n_vocab, (512,), generator=torch.Generator().manual_seed(0)).tolist()
    ctx = Context(model, n_seq_max=64, n_batch=512, n_ubatch=512)

    def measure(row: str) -> float:
        if row == "prefill512":
            ctx.memory.clear()
            t0 = time.perf_counter()
            ctx.decode(Batch(prompt))
            return (time.perf_counter() - t0) * 1e3
        n = int(row.removeprefix("decode"))
        ctx.memory.clear()
        ctx.decode(Batch.from_sequences({s: prompt[:4] for s in range(n)}))
        step = Batch.from_sequences({s: [prompt[s]] for s in range(n)})
        ctx.decode(step)  # warm
        t0 = time.perf_counter()
        for _ in range(args.steps):
            ctx.decode(step)
        return (time.perf_counter() - t0) / args.steps * 1e3

    for row in args.rows:  # compile and warm every shape once
        for p in args.policies:
            ops.set_pool(POLICIES[p])
            measure(row)
    samples: dict[tuple[str, str, str], list[float]] = {}
    for r in range(args.rounds):
        for mode in args.modes:
            hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if mode == "busy" else None
            try:
                time.sleep(0.2)
                for row in args.rows:
                    order = list(args.policies)
                    random.Random(r).shuffle(order)
                    for p in order:
                        ops.set_pool(POLICIES[p])
                        samples.setdefault((mode, row, p), []).append(measure(row))
            finally:
                if hog is not None:
                    hog.kill()
                    hog.wait()
        print(f"round {r + 1}/{args.rounds} done", file=sys.stderr, flush=True)
    ops.set_pool(200)
    name = args.gguf.name if args.gguf else args.model
    print(f"{name}, {torch.get_num_threads()} threads, ms a step, median [min-max] of {args.rounds} rounds")
    print(f"{'mode':6} {'row':11} " + " ".join(f"{p:>22}" for p in args.policies) + "   ratio to omp (worst)")
    for mode in args.modes:
        for row in args.rows:
            cells, base = [], samples.get((mode, row, "omp"))
            for p in args.policies:
                v = samples[(mode, row, p)]
                cells.append(f"{statistics.median(v):7.2f} [{min(v):6.2f}-{max(v):6.2f}]")
            ratios = ""
            if base is not None:
                for p in args.policies:
                    if p != "omp":
                        per = [a / b for a, b in zip(samples[(mode, row, p)], base, strict=True)]
                        ratios += f" {p} {statistics.median(per):.2f} ({max(per):.2f})"
            print(f"{mode:6} {row:11} " + " ".join(f"{c:>22}" for c in cells) + "  " + ratios)


if __name__ == "__main__":
    main()
