"""Thread count and OpenMP wait policy under contention: ms per step of rsmem's decode, interleaved.

One worker process per wait policy (torch's default: libgomp's threads spin; ``passive``: they sleep, what
``import rsmem`` sets) keeps the model loaded; the driver asks them in turn for one measurement at a time,
at each thread count, so the machine's drift (other processes, memory bandwidth) falls on every
configuration alike. ``--busy`` rounds run one CPU-bound process beside them (a neighbour that wants a core);
the others run without it. Rows: ``chunk8`` (a 64-token prompt prefilled in 8-token chunks, per chunk),
``prefill512`` (one 512-token chunk), ``decode1`` / ``decode8`` (one decode step of 1 / 8 sequences).

    python bench/threads.py --model default --rounds 5
    python bench/threads.py --model mamba2_130m --rounds 3 --rows decode1 decode8
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

WORKER = r"""
import json, os, sys, time
import torch  # before rsmem: the wait policy is the environment's, as the driver set it
import rsmem
from rsmem import Batch, Context
which, compile_ = sys.argv[1], sys.argv[2] == "1"
if which == "default":
    from rsmem.engine import default_model_path
    model = rsmem.load_model(default_model_path(), compile=compile_)
else:
    from rsmem.models.mamba import random_init
    model = getattr(random_init, which)()
    model.set_compile(compile_)
prompt = torch.randint(0, model.n_vocab, (512,), generator=torch.Generator().manual_seed(0)).tolist()
ctx = Context(model, n_seq_max=64, n_batch=512, n_ubatch=512)
steps = {}
def chunk8():
    ctx.memory.clear()
    for i in range(0, 64, 8):
        ctx.decode(Batch.from_sequences({0: prompt[i:i + 8]}))
    return 8
def prefill512():
    ctx.memory.clear(); ctx.decode(Batch(prompt)); return 1
def decode(n):
    def run():
        if n not in steps:
            ctx.memory.clear(); ctx.decode(Batch.from_sequences({s: prompt[:4] for s in range(n)}))
            steps[n] = Batch.from_sequences({s: [prompt[s]] for s in range(n)})
        for _ in range(8):
            ctx.decode(steps[n])
        steps.pop(n)  # the next round starts from a fresh prompt state (the memory is shared)
        return 8
    return run
ROWS = {"chunk8": chunk8, "prefill512": prefill512, "decode1": decode(1), "decode8": decode(8)}
ROWS["decode64"] = decode(64)
for fn in ROWS.values():
    fn()  # warm-up
print("ready", flush=True)
for line in sys.stdin:
    row, threads = line.split()
    torch.set_num_threads(int(threads))
    ROWS[row]()  # warm at this thread count
    t0 = time.perf_counter(); n = ROWS[row](); dt = time.perf_counter() - t0
    print(json.dumps(dt / n * 1e3), flush=True)
"""

POLICIES = {
    "default": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    # libgomp spins this many iterations after a parallel region, then sleeps (torch's default: 300,000)
    "spin300": {"GOMP_SPINCOUNT": "300"},
    "spin1k": {"GOMP_SPINCOUNT": "1000"},
    "spin3k": {"GOMP_SPINCOUNT": "3000"},
    "spin10k": {"GOMP_SPINCOUNT": "10000"},
    "spin30k": {"GOMP_SPINCOUNT": "30000"},
    "spin100k": {"GOMP_SPINCOUNT": "100000"},
}


class Worker:
    def __init__(self, policy: str, model: str, compile_: bool) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
        env |= POLICIES[policy] | {"RSMEM_OMP_PASSIVE": "0"}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", WORKER, model, "1" if compile_ else "0"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        assert self._line() == "ready"

    def _line(self) -> str:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"worker exited with {self.proc.wait()}")
        return line.strip()

    def measure(self, row: str, threads: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{row} {threads}\n")
        self.proc.stdin.flush()
        return float(json.loads(self._line()))

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        self.proc.wait(timeout=60)


def busy_neighbour() -> subprocess.Popen[bytes]:
    """One CPU-bound process (a pure-Python loop: one core's worth of demand)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default", help="default, or a rsmem.models.mamba.random_init builder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--rows", nargs="+", default=["chunk8", "prefill512", "decode1", "decode8"])
    ap.add_argument("--modes", nargs="+", choices=["busy", "quiet"], default=["busy", "quiet"])
    ap.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    ap.add_argument("--compile", action="store_true", help="compiled decode steps (default: eager)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    workers = {p: Worker(p, args.model, args.compile) for p in args.policies}
    samples: dict[tuple[str, str, str, int], list[float]] = {}
    try:
        for r in range(args.rounds):
            for mode in args.modes:
                hog = busy_neighbour() if mode == "busy" else None
                try:
                    for row in args.rows:
                        configs = [(p, t) for p in workers for t in args.threads]
                        random.shuffle(configs)
                        for policy, threads in configs:
                            ms = workers[policy].measure(row, threads)
                            samples.setdefault((mode, row, policy, threads), []).append(ms)
                finally:
                    if hog is not None:
                        hog.kill()
                        hog.wait()
            print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
    finally:
        for w in workers.values():
            w.close()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"\n{args.model}: ms per step, median of {args.rounds} interleaved rounds [min-max]; load {load:.1f}"
    )
    cols = [(p, t) for p in args.policies for t in args.threads]
    print(f"{'':8}{'row':12}" + "".join(f"{f'{p} t{t}':>24}" for p, t in cols))
    for mode in args.modes:
        for row in args.rows:
            cells = ""
            for p, t in cols:
                v = samples[(mode, row, p, t)]
                cells += f"{statistics.median(v):>9.1f} [{min(v):5.1f}-{max(v):6.1f}]"
            print(f"{mode:8}{row:12}{cells}")


if __name__ == "__main__":
    main()
