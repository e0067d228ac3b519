"""Decode speed of two checkouts of rsmem on the same 130M models, in interleaved rounds: did a change (a
refactor, a new layout) keep the model step's speed?

    python bench/compare_trees.py /path/to/old/checkout . --rounds 5

Each round runs both checkouts (in alternating order) in fresh processes (``PYTHONPATH=<tree>/src``), each
loading the same GGUF files and timing ``rsmem.benchmark.measure``'s decode steps at the ``--parallel``
widths. The models are random 130M Mamba-2 (transformers' config, converted by rsmem) and RWKV-7 (BlinkDL
layout, converted by rsmem), written once to a temporary folder. The table gives each tree's median
tokens/s, the median of the per-round ratios (second tree / first) and the lowest round's ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

CHILD = """
import json, sys
import rsmem
from rsmem.benchmark import measure
from rsmem.loaders import load_model
path, threads, widths, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
model = load_model(path, n_threads=threads)
t = measure(model, path, n_prompt=64, parallel=tuple(int(w) for w in widths.split(",")), steps=steps)
print(json.dumps(t.decode_tok_s))
"""


def build_models(folder: Path) -> dict[str, Path]:
    from transformers import Mamba2ForCausalLM

    import rsmem
    from archs_rwkv import make_build
    from throughput import hf_config

    torch.manual_seed(0)
    hf = folder / "mamba2-hf"
    Mamba2ForCausalLM(hf_config("mamba2")).save_pretrained(hf)
    mamba2 = rsmem.convert(hf, folder / "mamba2-f32.gguf", "f32")
    rwkv_folder = folder / "rwkv7"
    rwkv_folder.mkdir()
    return {"Mamba-2 130M": Path(mamba2), "RWKV-7 (768 x 12)": Path(make_build(7)(rwkv_folder))}


def run(tree: Path, model: Path, args: argparse.Namespace) -> dict[int, float]:
    env = {**os.environ, "PYTHONPATH": str(tree / "src")}
    widths = ",".join(map(str, args.parallel))
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(model), str(args.threads), widths, str(args.steps)],
        env=env,
        cwd=tree,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return {int(k): v for k, v in json.loads(out.strip().splitlines()[-1]).items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("first", type=Path, help="the checkout measured as the baseline")
    ap.add_argument("second", type=Path, help="the checkout compared with it")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per width")
    ap.add_argument("--parallel", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    trees = (args.first.resolve(), args.second.resolve())
    with tempfile.TemporaryDirectory() as tmp:
        models = build_models(Path(tmp))
        results: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for r in range(args.rounds):
            for name, path in models.items():
                order = trees if r % 2 == 0 else trees[::-1]
                got = {tree: run(tree, path, args) for tree in order}
                for w in args.parallel:
                    results.setdefault((name, w), []).append((got[trees[0]][w], got[trees[1]][w]))
                print(f"round {r + 1}/{args.rounds} {name} done", file=sys.stderr)
    print(f"first: {trees[0]}\nsecond: {trees[1]}\n{args.threads} threads, {args.rounds} rounds\n")
    print("| model | sequences | first tok/s | second tok/s | second/first (median) | lowest round | range |")
    print("|---|---|---|---|---|---|---|")
    for (name, w), rows in results.items():
        ratios = [b / a for a, b in rows]
        print(
            f"| {name} | {w} | {statistics.median(a for a, _ in rows):,.0f} | "
            f"{statistics.median(b for _, b in rows):,.0f} | {statistics.median(ratios):.3f} | "
            f"{min(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |"
        )


if __name__ == "__main__":
    main()
