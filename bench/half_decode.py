"""A model's steps with its F16 / BF16 matrices kept 2 bytes a value against the same model widened to
float32 at load (the loaders' path without kernels), in one process, interleaved.

Rows: decode steps of 1, 3 and 8 sequences (one token each, every sequence's logits), prefills of 22 and
512 tokens (one sequence); torch threads 1 and 2; compiled decode steps (``--compile 1``, as the server
runs them). Each round runs every row with both models back to back, the order alternating between
rounds; the table gives the median CPU time (all the process's threads: ``time.process_time``) and wall
time per step, the median of the per-round kept/widened wall ratios and the lowest round's ratio, and the
load average before and after.

    PYTHONPATH=src python bench/half_decode.py --rounds 5            # the embedded model
    PYTHONPATH=src python bench/half_decode.py --gguf model-f16.gguf --rows decode1 prefill512
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path

# isort: off
import rsmem  # first: it sets OpenMP's wait policy, which libgomp reads when torch loads (rsmem.threads)
import torch

# isort: on

from rsmem.engine import default_model_path
from rsmem.kernels.formats import HALF_TYPES
from rsmem.loaders.gguf import read_gguf
from rsmem.loaders.registry import build_model
from rsmem.models.ops.quantized import QuantMatrix

ROWS = ("decode1", "decode3", "decode8", "prefill22", "prefill512")


def load(path: Path, widen: bool, compile_decode: bool) -> object:
    """The model of ``path``; ``widen``: its F16 / BF16 matrices as float32 (as loaded without kernels)."""
    ckpt = read_gguf(path)
    if widen:
        for name, matrix in list(ckpt.quantized.items()):
            if matrix.qtype in HALF_TYPES:
                ckpt.tensors[name] = matrix.dequantize()
                del ckpt.quantized[name]
    model = build_model(ckpt, compile=compile_decode)
    if hasattr(model, "warm_up"):
        model.warm_up()
    return model


def held(model: object) -> str:
    m = getattr(model.layers[0], model.matrices[0])  # type: ignore[attr-defined]
    return repr(m) if isinstance(m, QuantMatrix) else f"{m.dtype} {tuple(m.shape)}"


def workload(model: object, row: str, n_vocab: int) -> tuple[Callable[[], None], int]:
    """A function running ``reps`` steps of ``row`` on a fresh context, and ``reps``."""
    ctx = rsmem.Context(model, n_seq_max=8)  # type: ignore[arg-type]
    tokens = [(7 * i + 3) % n_vocab for i in range(512)]
    if row.startswith("prefill"):
        n = int(row.removeprefix("prefill"))
        reps = 8 if n < 100 else 2

        def run() -> None:
            for _ in range(reps):
                ctx.memory.seq_rm(0, -1, -1)
                ctx.decode(rsmem.Batch(tokens[:n], seq_ids=[[0]] * n))

        return run, reps
    n_seq = int(row.removeprefix("decode"))
    for s in range(n_seq):
        ctx.decode(rsmem.Batch(tokens[:8], seq_ids=[[s]] * 8))
    reps = 48 if n_seq < 8 else 24

    def step() -> None:
        for i in range(reps):
            batch = [tokens[(i + s) % 512] for s in range(n_seq)]
            ctx.decode(rsmem.Batch(batch, seq_ids=[[s] for s in range(n_seq)], logits=[True] * n_seq))

    return step, reps


def timed(fn: Callable[[], None], reps: int) -> tuple[float, float]:
    """(CPU ms, wall ms) per step of one call of ``fn``."""
    c, w = time.process_time(), time.perf_counter()
    fn()
    return (time.process_time() - c) / reps * 1e3, (time.perf_counter() - w) / reps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gguf", type=Path, default=None, help="the model (default: the embedded one)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    p.add_argument("--compile", choices=["1", "0"], default="1")
    args = p.parse_args()
    path = args.gguf or default_model_path()
    models = {kind: load(path, kind == "widened", args.compile == "1") for kind in ("kept", "widened")}
    n_vocab = models["kept"].n_vocab  # type: ignore[attr-defined]
    print(f"{path.name}: kept {held(models['kept'])}, widened {held(models['widened'])}")
    print(f"load average before: {os.getloadavg()}")
    print(
        "| threads | row | kept CPU ms | kept wall ms | widened CPU ms | widened wall ms | kept/widened wall "
        "(median) | lowest round |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for threads in (int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for row in args.rows:
            runs = {kind: workload(m, row, n_vocab) for kind, m in models.items()}
            for fn, _reps in runs.values():
                fn()  # warm: compiled variants, caches
            times: dict[str, list[tuple[float, float]]] = {"kept": [], "widened": []}
            for r in range(args.rounds):
                order = ("kept", "widened") if r % 2 == 0 else ("widened", "kept")
                for kind in order:
                    times[kind].append(timed(*runs[kind]))
            ratios = [k[1] / w[1] for k, w in zip(times["kept"], times["widened"], strict=True)]
            med = {
                kind: tuple(statistics.median(t[i] for t in v) for i in (0, 1)) for kind, v in times.items()
            }
            print(
                f"| {threads} | {row} | {med['kept'][0]:.3f} | {med['kept'][1]:.3f} | "
                f"{med['widened'][0]:.3f} | {med['widened'][1]:.3f} | {statistics.median(ratios):.2f} | "
                f"{min(ratios):.2f} |",
                flush=True,
            )
    print(f"load average after: {os.getloadavg()}")


if __name__ == "__main__":
    main()
