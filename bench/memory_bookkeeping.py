"""Time of the recurrent memory's own work per decode step, at 1, 8, 64 and 256 parallel sequences.

A decode step of N sequences (one token each) goes through: the batch allocator (validate, auto-fill,
split), ``init_batch`` (the dry-run ``prepare``), ``apply`` (``find_slot``), and the state movement a
model performs through the memory context (zero row, ``s_copy`` gather, scatter of new states) for
every layer. The model itself is replaced by nothing, so what is measured is pure overhead.
State rows are Mamba-130M sized (24 layers, d_inner 1536, d_state 16, d_conv 4), f32.

Side by side, "gather all" times the alternative that llama.cpp's graph uses: every row of the
touched range gathered through ``s_copy`` on every step, whether it moved or not.

Two workloads: "steady" (the same N sequences step after step, cells already in place) and "churn"
(each step one sequence is dropped and a fresh one forked from another, so find_slot copies and
reorders cells).

Run: .venv/bin/python bench/memory_bookkeeping.py [--steps 50]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import torch

from rsmem import Batch, BatchAllocator
from rsmem.memory.recurrent import RecurrentMemory, StateShape

N_LAYER, D_INNER, D_STATE, D_CONV = 24, 1536, 16, 4
SHAPE = StateShape(N_LAYER, (D_CONV - 1) * D_INNER, D_STATE * D_INNER)
VOCAB = 50280


def one_step(
    memory: RecurrentMemory, balloc: BatchAllocator, seqs: list[int], times: dict[str, float]
) -> None:
    batch = Batch([1] * len(seqs), seq_ids=[[s] for s in seqs], logits=[True] * len(seqs))
    t0 = time.perf_counter()
    balloc.init(batch, n_vocab=VOCAB, n_seq_max=memory.size, memory=memory)
    t1 = time.perf_counter()
    mctx = memory.init_batch(balloc, n_ubatch=512)
    t2 = time.perf_counter()
    mctx.apply()
    t3 = time.perf_counter()
    for il in range(N_LAYER):
        r, s = mctx.read_states(il)
        mctx.write_states(il, r, s)
    t4 = time.perf_counter()
    # the alternative: llama.cpp's graph gathers every row [head, head+n) through s_copy each step
    index = mctx.copy_index()
    head = mctx.head
    for il in range(N_LAYER):
        for t in (memory.r_l[il], memory.s_l[il]):
            t[head : head + len(index)] = t.index_select(0, index)
    t5 = time.perf_counter()
    mctx.next()
    times["allocator"] += t1 - t0
    times["init_batch"] += t2 - t1
    times["apply"] += t3 - t2
    times["states"] += t4 - t3
    times["gather all"] += t5 - t4


def run(n_seqs: int, steps: int, churn: bool) -> dict[str, float]:
    memory = RecurrentMemory(SHAPE, n_seqs)
    balloc = BatchAllocator()
    seqs = list(range(n_seqs))
    warm: dict[str, float] = defaultdict(float)
    one_step(memory, balloc, seqs, warm)
    times: dict[str, float] = defaultdict(float)
    for step in range(steps):
        if churn and n_seqs > 1:
            victim = step % n_seqs
            memory.seq_rm(victim, -1, -1)
            memory.seq_cp((victim + 1) % n_seqs, victim)
        one_step(memory, balloc, seqs, times)
    memory.check_invariants()
    return {k: v / steps * 1e6 for k, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cols = ["allocator", "init_batch", "apply", "states"]
    print(f"memory bookkeeping per decode step, microseconds (mean of {args.steps} steps)")
    print("states = zero row + moving the rows whose source is elsewhere, 24 layers of Mamba-130M-sized rows")
    print(
        "gather all = the alternative, llama.cpp's way: every row of [head, head+n) gathered through s_copy"
    )
    header = f"{'workload':>8} {'seqs':>5} " + " ".join(f"{c:>11}" for c in cols)
    header += f" {'total':>10} {'per seq':>9} {'gather all':>11}"
    print(header)
    print("-" * len(header))
    for churn in (False, True):
        for n in (1, 8, 64, 256):
            t = run(n, args.steps, churn)
            total = sum(t[c] for c in cols)
            row = f"{'churn' if churn else 'steady':>8} {n:>5} " + " ".join(f"{t[c]:>11.1f}" for c in cols)
            print(row + f" {total:>10.1f} {total / n:>9.2f} {t['gather all']:>11.1f}")


if __name__ == "__main__":
    main()
