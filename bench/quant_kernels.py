"""Per-matrix times of rsmem.kernels.qmatmul against the dense float32 and bfloat16 products.

Shapes of the 130M models (Mamba in_proj / out_proj, Mamba-2 in_proj, the head), M activation rows (1 =
one-sequence decode, 8 and 64 = batched decode, 512 = prefill), torch threads 1 and 2. Each round times
every configuration once (interleaved rounds, so a busy neighbour slows all of them alike); the table gives
the median over rounds, the worst round, and the median of per-round ratios to the f32 product.

    PYTHONPATH=src python bench/quant_kernels.py --rounds 5
    PYTHONPATH=src python bench/quant_kernels.py --shapes in_proj --m 1,8 --types q8_0,q4_k --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from rsmem.kernels import KERNEL_TYPES, qmatmul
from rsmem.kernels.build import native_ops
from rsmem.kernels.formats import block_shape

SHAPES = {"in_proj": (3072, 768), "out_proj": (768, 1536), "m2_in_proj": (3352, 768), "head": (50280, 768)}
TYPES = {t.name.lower(): t for t in KERNEL_TYPES}


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    """Random block bytes with small finite f16 scales where each layout keeps them."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--m", default="1,8,64,512")
    ap.add_argument("--types", default=",".join(TYPES))
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.05, help="seconds per timing")
    ap.add_argument("--no-bf16", action="store_true")
    args = ap.parse_args()
    print(f"kernels: {native_ops().isa() if native_ops() is not None else 'reference (disabled/failed)'}")

    rng = np.random.default_rng(0)
    cases: list[tuple[str, int, int, str, Callable[[], object]]] = []
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w32 = torch.randn(n, k) * 0.02
        w16 = w32.to(torch.bfloat16)
        blocks = {name: random_blocks(TYPES[name], n, k, rng) for name in args.types.split(",")}
        for m in (int(v) for v in args.m.split(",")):
            x = torch.randn(m, k)
            x16 = x.to(torch.bfloat16)
            for th in (int(v) for v in args.threads.split(",")):
                cases.append((shape, m, th, "f32", lambda x=x, w=w32: F.linear(x, w)))
                if not args.no_bf16:
                    cases.append((shape, m, th, "bf16", lambda x=x16, w=w16: F.linear(x, w)))
                for name, b in blocks.items():
                    t, kk = TYPES[name], k
                    cases.append((shape, m, th, name, lambda x=x, b=b, t=t, kk=kk: qmatmul(x, b, t, kk)))

    times: dict[tuple[str, int, int, str], list[float]] = {c[:4]: [] for c in cases}
    with torch.inference_mode():
        for r in range(args.rounds):
            for shape, m, th, kind, fn in cases:
                torch.set_num_threads(th)
                times[(shape, m, th, kind)].append(per_call(fn, args.min_time))
            print(f"round {r + 1}/{args.rounds} done", flush=True)

    print(f"\n{'shape':<11}{'M':>5}{'thr':>4}  {'kind':<6}{'median ms':>11}{'worst ms':>10}{'vs f32':>8}")
    for (shape, m, th, kind), ts in times.items():
        base = times[(shape, m, th, "f32")]
        ratio = statistics.median(b / t for b, t in zip(base, ts))
        print(
            f"{shape:<11}{m:>5}{th:>4}  {kind:<6}{statistics.median(ts) * 1e3:>11.3f}"
            f"{max(ts) * 1e3:>10.3f}{ratio:>7.2f}x"
        )


if __name__ == "__main__":
    main()
