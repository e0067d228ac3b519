"""The ``rsmem`` command line."""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from rsmem import Batch, Context
from rsmem.models import DecayedSumModel


def cmd_demo(args: argparse.Namespace) -> int:
    """Walk through the recurrent memory: parallel decode, fork, save and restore, on the toy model."""
    model = DecayedSumModel(n_vocab=64, n_embd=8, n_layer=4)
    ctx = Context(model, n_seq_max=args.parallel)
    prompts = {s: [(7 * s + k) % 64 for k in range(3 + s)] for s in range(args.parallel)}
    t0 = time.perf_counter()
    ctx.decode(Batch.from_sequences(prompts))
    print(f"decoded {sum(map(len, prompts.values()))} prompt tokens of {len(prompts)} sequences in one batch")
    mem = ctx.memory
    print(
        f"memory: {mem.used} cells used of {mem.size}, {mem.state_bytes_per_seq()} state bytes per sequence"
    )
    if args.parallel > 1:
        mem.seq_rm(args.parallel - 1, -1, -1)
        mem.seq_cp(0, args.parallel - 1)
        print(f"forked sequence 0 into {args.parallel - 1} (shared cell, no copy): {mem.used} cells used")
    for _ in range(args.steps):
        ctx.decode(Batch.from_sequences({s: [s % 64] for s in range(args.parallel)}))
    print(f"decoded {args.steps} steps of {args.parallel} sequences: {mem.used} cells used")
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "seq0.ggsq"
        size = ctx.state_seq_save_file(path, 0, prompts[0])
        tokens = ctx.state_seq_load_file(path, 0)
        print(f"saved sequence 0 to a llama.cpp-format file ({size} bytes), restored {len(tokens)} tokens")
    print(f"done in {time.perf_counter() - t0:.3f}s")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rsmem", description="Recurrent language models on a recurrent memory"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="walk through the recurrent memory on a toy model")
    demo.add_argument("--parallel", type=int, default=4, help="number of sequences (default 4)")
    demo.add_argument("--steps", type=int, default=8, help="decode steps after the prompts (default 8)")
    demo.set_defaults(func=cmd_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
