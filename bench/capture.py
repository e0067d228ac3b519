"""Prefill with checkpoints every 64 tokens: chunks cut at each checkpoint, against one chunk with the
states captured inside it (``Context.decode(batch, capture=...)``), against no checkpoints at all.

130M-class random Mamba and Mamba-2 (``rsmem.models.mamba.random_init``), f32, one sequence, a 512-token
prompt,
checkpoints (exact codec) after tokens 64, 128, ..., 512:

- ``none``: one decode of the prompt, no checkpoint;
- ``cut``: the prompt as 64-token decodes, ``checkpoint.take`` after each (what the engine did);
- ``captured``: one decode with ``capture={0: [64, 128, ..., 512]}``.

The machine's speed drifts, so each round runs every mode once, back to back (modes in a rotating order),
and the table gives each mode's median and lowest round in ms. ``--clock cpu`` times the process's CPU
time instead of the wall clock: on a machine shared with other work (wall times that varied 3x between
rounds here) one thread's CPU time is the steadier measure.

    .venv/bin/python bench/capture.py [--arch mamba2] [--rounds 7] [--compile auto|1|0] [--threads 2]
        [--clock wall|cpu]

``--modes none`` with ``PYTHONPATH`` pointing at another checkout's ``src`` times that checkout's prefill.

Measured on this machine (2 cores shared with other work; ``--threads 1 --clock cpu``, 5-7 rounds; ms,
median (lowest)); ``--every 60`` puts the points inside Mamba-2's 64-token SSD chunks and Mamba's 16-token
scan blocks, where they cost a partial sum (Mamba-2) or one more block (Mamba) each:

| | none | cut | captured |
|---|---|---|---|
| Mamba, compiled scan blocks, every 64 | 1588 (1544) | 1973 (1944) | 1646 (1539) |
| Mamba, eager chunked scan, every 64 | 2346 (2324) | 2724 (2626) | 2374 (2333) |
| Mamba-2, every 64 | 1651 (1561) | 2024 (1853) | 1651 (1573) |
| Mamba, compiled, every 60 | 1653 (1611) | 2195 (1943) | 1761 (1650) |
| Mamba-2, every 60 | 1622 (1592) | 1895 (1878) | 1765 (1756) |

Cutting the chunks costs 15-33% of the prefill; captures cost 0-4% at chunk-aligned points (medians;
the lowest rounds within 1%) and 6-9% with eight points inside chunks (Mamba-2: 0.3-0.65 ms a point a
layer for the partial sum, by its length).
Without captures the prefill is unchanged: the same logits bit for bit, and in a paired run against the
tree before captures (one process, alternating, 8 rounds) new/base was 0.998 (0.93-1.04) for Mamba-2
and 1.025 (0.91-1.06, equal lowest rounds) for Mamba.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import rsmem
from rsmem import Batch, Context
from rsmem.memory import checkpoint
from rsmem.models.mamba.random_init import mamba2_130m, mamba_130m

MODES = ("none", "cut", "captured")


def runners(model, n_prompt: int, every: int) -> dict[str, Callable[[], None]]:
    ctx = Context(model, n_seq_max=1, n_batch=n_prompt, n_ubatch=n_prompt)
    prompt = [(7 * i) % 50000 + 1 for i in range(n_prompt)]
    points = list(range(every, n_prompt + 1, every))

    def none() -> None:
        ctx.memory.clear()
        ctx.decode(Batch(prompt))

    def cut() -> None:
        ctx.memory.clear()
        kept = []
        for a, b in zip([0, *points], points, strict=False):
            ctx.decode(Batch(prompt[a:b]))
            kept.append(checkpoint.take(ctx.memory, 0))
        assert len(kept) == len(points)

    def captured() -> None:
        ctx.memory.clear()
        ctx.decode(Batch(prompt), capture={0: points})
        assert len(ctx.captured()) == len(points)

    return {"none": none, "cut": cut, "captured": captured}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--arch", choices=["mamba", "mamba2", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--every", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--compile", choices=["auto", "1", "0"], default="auto")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    ap.add_argument("--clock", choices=["wall", "cpu"], default="wall")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"rsmem {rsmem.__file__}, torch {torch.__version__}, {args.threads} threads")
    clock = time.perf_counter if args.clock == "wall" else time.process_time
    print(f"prompt {args.prompt}, checkpoints every {args.every}; {args.clock} ms a prefill, median (lowest)")
    for arch in ["mamba", "mamba2"] if args.arch == "both" else [args.arch]:
        model = (mamba_130m if arch == "mamba" else mamba2_130m)(0)
        model.set_compile(args.compile)
        run = {m: f for m, f in runners(model, args.prompt, args.every).items() if m in args.modes}
        for f in run.values():  # warm-up (compiles the scan blocks when compiling)
            f()
        times: dict[str, list[float]] = {m: [] for m in run}
        for r in range(args.rounds):
            order = list(run)[r % len(run) :] + list(run)[: r % len(run)]
            for m in order:
                t0 = clock()
                run[m]()
                times[m].append((clock() - t0) * 1e3)
        cells = [f"{m} {statistics.median(t):7.1f} ({min(t):7.1f})" for m, t in times.items()]
        print(f"{arch:7s} compile={model.compile_decode!s:5s} " + "  ".join(cells))


if __name__ == "__main__":
    main()
