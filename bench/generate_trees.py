"""End-to-end ``rsmem generate`` speed of two checkouts, in interleaved rounds: what a user sees.

    python bench/generate_trees.py /path/to/old/checkout . --rounds 5 [--tokens 1000] [--model FILE]

Each round runs both checkouts (in alternating order) in fresh processes (``PYTHONPATH=<tree>/src``) on the
same model (the embedded one by default), greedy and at temperature 0.8 (the CLI's other defaults: top-k 40,
top-p 0.95, min-p 0.05), ``--tokens`` tokens after the prompt "ROMEO:" with ``--ignore-eos``, and reads the
generated tokens/s that the command prints. The table gives each tree's median with its range, the median of
the per-round ratios (second tree / first) and the lowest round's ratio.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

SPEED = re.compile(r"([\d.]+) tok/s generated")


def run(tree: Path, temp: str, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    cmd = [sys.executable, "-m", "rsmem.cli", "generate", "ROMEO:", "-n", str(args.tokens), "--temp", temp]
    cmd += ["--seed", "1", "--ignore-eos", "-t", str(args.threads)]
    if args.model:
        cmd += ["-m", args.model]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    found = SPEED.search(out.stderr)
    if found is None:
        raise SystemExit(f"no speed line from {tree}: {out.stderr[-500:]}")
    return float(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first", type=Path)
    ap.add_argument("second", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", default=None)
    args = ap.parse_args()
    trees = (args.first.resolve(), args.second.resolve())
    print(f"| sampling | {trees[0].name} tok/s | {trees[1].name} tok/s | ratio, median | lowest round |")
    print("|---|---|---|---|---|")
    for label, temp in (("greedy", "0"), ("temperature 0.8", "0.8")):
        speeds: dict[Path, list[float]] = {t: [] for t in trees}
        ratios = []
        for k in range(args.rounds):
            order = trees if k % 2 == 0 else trees[::-1]
            got = {t: run(t, temp, args) for t in order}
            for t in trees:
                speeds[t].append(got[t])
            ratios.append(got[trees[1]] / got[trees[0]])
        cells = [
            f"{statistics.median(speeds[t]):,.0f} ({min(speeds[t]):,.0f}-{max(speeds[t]):,.0f})"
            for t in trees
        ]
        print(f"| {label} | {cells[0]} | {cells[1]} | {statistics.median(ratios):.2f} | {min(ratios):.2f} |")


if __name__ == "__main__":
    main()
