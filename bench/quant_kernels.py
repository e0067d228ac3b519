"""Per-matrix times of rsmem.kernels.qmatmul against the dense float32 and bfloat16 products.

Shapes of the 130M models (Mamba in_proj / out_proj, Mamba-2 in_proj, the head), M activation rows (1 =
one-sequence decode, 8 and 64 = batched decode, 512 = prefill), torch threads 1 and 2. Each round times
every configuration once (interleaved rounds, so a busy neighbour slows all of them alike); the table gives
the median over rounds, the worst round, and the median of per-round ratios to the f32 product.

``--cold``: each matrix is held in enough copies (at least 64 MiB together) that successive calls read
weights from memory, not from the 32 MiB L3 cache, as a model's decode step does.

    PYTHONPATH=src python bench/quant_kernels.py --rounds 5
    PYTHONPATH=src python bench/quant_kernels.py --shapes in_proj --m 1,8 --types q8_0,q4_k --threads 1
    PYTHONPATH=src python bench/quant_kernels.py --routes 0,3 --m 1  # also each C++ route forced (kind@route)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import numpy as np

# isort: off
import rsmem  # first: it sets OpenMP's wait policy, which libgomp reads when torch loads (rsmem.threads)
import torch
import torch.nn.functional as F

# isort: on

from rsmem.kernels import HALF_TYPES, MATRIX_TYPES, qmatmul
from rsmem.kernels.build import native_ops
from rsmem.kernels.formats import block_shape

SHAPES = {"in_proj": (3072, 768), "out_proj": (768, 1536), "m2_in_proj": (3352, 768), "head": (50280, 768)}
TYPES = {t.name.lower(): t for t in MATRIX_TYPES}  # f16 and bf16: rows of 2-byte values (kept as stored)


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random block bytes with small finite f16 scales where each layout keeps them; F16 / BF16 rows of
    random values."""
    if qtype in HALF_TYPES:
        values = torch.from_numpy(rng.standard_normal((n, k), dtype=np.float32) * 0.02)
        return values.to(torch.float16 if qtype == HALF_TYPES[0] else torch.bfloat16).view(torch.uint8)
    bs, ts = block_shape(qtype)
    b = rng.integers(0, 256, (n, k // bs, ts), dtype=np.uint8)
    d = (rng.random((n, k // bs)) * 0.02 + 0.001).astype(np.float16).view(np.uint8).reshape(n, k // bs, 2)
    for off in {8: (0,), 2: (0,), 12: (0, 2), 13: (0, 2), 14: (208,)}[int(qtype)]:
        b[:, :, off : off + 2] = d
    return torch.from_numpy(b.reshape(n, -1).copy())


def per_call(fn: Callable[[], object], min_s: float) -> float:
    """Seconds per call: repeated until ``min_s`` has passed (at least 3 calls, after one warm-up)."""
    fn()
    n, t0 = 0, time.perf_counter()
    while True:
        fn()
        n += 1
        elapsed = time.perf_counter() - t0
        if n >= 3 and elapsed >= min_s:
            return elapsed / n


def rotating(calls: list[Callable[[], object]]) -> Callable[[], object]:
    """One call after the other, round and round."""
    state = [0]

    def call() -> object:
        state[0] = (state[0] + 1) % len(calls)
        return calls[state[0]]()

    return call


def copies_for(nbytes: int, cold: bool) -> int:
    return max(1, -(-COLD_BYTES // nbytes)) if cold else 1


COLD_BYTES = 64 << 20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", default="1,8,64,512")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per timing")
    ap.add_argument("--no-bf16", action="store_true")
    ap.add_argument("--cold", action="store_true", help="weights read from memory, not cache")
    ap.add_argument(
        "--routes",
        default="",
        help="C++ routes to time as well, forced (0 registers, 1 f32 tiles, 2 bf16 tiles, 3 int8; f16 / "
        "bf16: 0 registers, 1 widened chunks); "
        "a route without a kernel for a type is skipped",
    )
    args = ap.parse_args()
    ops = native_ops()
    print(f"rsmem {rsmem.__version__}: OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}")
    print(f"kernels: {ops.isa() if ops is not None else 'reference (disabled or failed)'}; cold: {args.cold}")

    rng = np.random.default_rng(0)
    cases: list[tuple[str, int, int, str, Callable[[], object]]] = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w32 = [torch.randn(n, k) * 0.02 for _ in range(copies_for(n * k * 4, args.cold))]
        w16 = [w.to(torch.bfloat16) for w in w32[: copies_for(n * k * 2, args.cold)]]
        blocks = {}
        for name in args.types.split(","):
            b = random_blocks(TYPES[name], n, k, rng)
            blocks[name] = [b] + [b.clone() for _ in range(copies_for(b.numel(), args.cold) - 1)]
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k)
            x16 = x.to(torch.bfloat16)
            for th in (int(v) for v in args.threads.split(",")):
                cases.append((shape, m, th, "f32", rotating([partial(F.linear, x, w) for w in w32])))
                if not args.no_bf16:
                    cases.append((shape, m, th, "bf16", rotating([partial(F.linear, x16, w) for w in w16])))
                for name, bs in blocks.items():
                    calls = [partial(qmatmul, x, b, TYPES[name], k) for b in bs]
                    cases.append((shape, m, th, name, rotating(calls)))
                    for route in (int(r) for r in args.routes.split(",") if r):
                        forced = [partial(ops.qmatmul, x, b, int(TYPES[name]), k, route) for b in bs]
                        try:
                            forced[0]()
                        except (RuntimeError, ValueError):
                            continue
                        cases.append((shape, m, th, f"{name}@{route}", rotating(forced)))

    times: dict[tuple[str, int, int, str], list[float]] = {c[:4]: [] for c in cases}
    with torch.inference_mode():
        for r in range(args.rounds):
            for shape, m, th, kind, fn in cases:
                torch.set_num_threads(th)
                times[(shape, m, th, kind)].append(per_call(fn, args.min_time))
            print(f"round {r + 1}/{args.rounds} done", flush=True)

    print(f"\n{'shape':<11}{'M':>5}{'thr':>4}  {'kind':<9}{'median ms':>11}{'worst ms':>10}{'vs f32':>8}")
    for (shape, m, th, kind), ts in times.items():
        base = times[(shape, m, th, "f32")]
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(
            f"{shape:<11}{m:>5}{th:>4}  {kind:<9}{statistics.median(ts) * 1e3:>11.3f}"
            f"{max(ts) * 1e3:>10.3f}{ratio:>7.2f}x"
        )


if __name__ == "__main__":
    main()
