"""Where a decode step's time goes: the engine's parts beside the model step's own time.

    python bench/overhead.py [--models embedded,mamba2-130m] [--seqs 1,8,64] [--steps 200] [--rounds 3]

For each model and number of sequences, one engine runs that many requests (short prompts, ``ignore_eos``,
greedy and then temperature 0.8 with top-k 40, top-p 0.95, min-p 0.05, repetition penalty 1.1) for
``--steps`` decode steps after a warm-up, with a timer around each part of ``Engine.step``:

- ``schedule``: admission and the step's plan (``Engine._schedule``);
- ``batch``: the ``Batch`` built from the plan (``scheduler.build_batch``);
- ``memory``: ``Context.decode`` outside the model's forward (batch split, slot placement, logits);
- ``model``: the model's forward (its C++ step where it has one);
- ``sample``: the vectorised sampler;
- ``append``: appending each token, EOS / stop-string / length checks and detokenisation;
- ``detok``: the detokenisation part of ``append`` (one row of the table, also counted in ``append``);
- ``report``: the reports handed to callers;
- ``other``: whatever else ``Engine.step`` spends (commit, bookkeeping);
- ``server``: what the server adds a step for the reports (SSE chunks as ``/v1/completions`` streams them);
- ``step alone``: ``Context.decode`` of the same one-token-per-sequence batch in a loop, no engine: the
  model step as llama.cpp's ``llama_decode`` is timed.

Every figure is microseconds a step (median over rounds; the spread is the lowest and highest round); the
last columns give the share of an engine step outside the model and tokens/s end to end. The 130M model is a
random Mamba-2 (transformers' config, converted by rsmem; token ids only, so no detokenisation).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

# isort: off
import rsmem  # first: it sets OpenMP's wait policy before torch loads (rsmem.threads)
import torch

# isort: on

import rsmem.engine.engine as engine_module
from rsmem.batch import Batch
from rsmem.engine import LLM, SamplingParams
from rsmem.engine.tokenizer import IncrementalDetokenizer

sys.path.insert(0, str(Path(__file__).parent))

PARTS = ("schedule", "batch", "memory", "model", "sample", "append", "detok", "report", "other", "server")
SAMPLED = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repetition_penalty=1.1)


class Timers:
    """Accumulated seconds per part while ``on``; wrappers add a perf_counter pair a call."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.on = False

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.on:
                return fn(*args, **kwargs)
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total[name] += time.perf_counter() - t0

        return timed


def instrument(llm: LLM, timers: Timers) -> None:
    engine = llm.engine
    engine._schedule = timers.wrap("schedule", engine._schedule)  # type: ignore[method-assign]
    engine_module.build_batch = timers.wrap("batch", engine_module.build_batch)
    engine_module.report = timers.wrap("report", engine_module.report)
    engine.ctx.decode = timers.wrap("decode", engine.ctx.decode)  # type: ignore[method-assign]
    llm.model.forward = timers.wrap("model", llm.model.forward)  # type: ignore[method-assign]
    engine.output.sampler.sample = timers.wrap("sample", engine.output.sampler.sample)  # type: ignore[method-assign]
    engine.output._append = timers.wrap("append", engine.output._append)  # type: ignore[method-assign]
    IncrementalDetokenizer.push = timers.wrap("detok", IncrementalDetokenizer.push)  # type: ignore[method-assign]


def server_chunks(reports: list[Any], fmt: Any) -> float:
    """Seconds to turn one step's reports into SSE bytes as the completions stream does."""
    from rsmem.server.streaming import sse

    t0 = time.perf_counter()
    b"".join(sse(c) for out in reports for c in fmt.chunks(out))
    return time.perf_counter() - t0


def completion_format(request_ids: list[str]) -> Any:
    from rsmem.server.responses import CompletionChunks, Envelope

    return CompletionChunks(Envelope("cmpl-bench", 0, "bench", tuple(request_ids), 1), None)  # type: ignore[arg-type]


def engine_round(
    llm: LLM, n_seqs: int, params: SamplingParams, steps: int, vocab: int | None
) -> dict[str, float]:
    """One round: ``n_seqs`` requests, ``steps`` timed decode steps; microseconds a step per part."""
    timers: Timers = llm._bench_timers  # type: ignore[attr-defined]
    engine = llm.engine
    prompts: list[Any] = (
        [f"Prompt {k}: once upon a time" for k in range(n_seqs)]
        if vocab is None
        else [[(7 * k + j) % vocab for j in range(8)] for k in range(n_seqs)]
    )
    params = dataclasses.replace(params, max_tokens=steps + 8, ignore_eos=True, seed=1)
    ids = engine.add_requests(prompts, params)
    for _ in range(4):  # prefill and the first decode steps, untimed
        engine.step()
    fmt = completion_format(ids)
    timers.total.clear()
    timers.on = True
    server = 0.0
    t0 = time.perf_counter()
    for _ in range(steps):
        server += server_chunks(engine.step(), fmt)
    wall = time.perf_counter() - t0 - server
    timers.on = False
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished:
        engine.step()
    t = timers.total
    parts = {
        "schedule": t["schedule"],
        "batch": t["batch"],
        "memory": t["decode"] - t["model"],
        "model": t["model"],
        "sample": t["sample"],
        "append": t["append"],
        "detok": t["detok"],
        "report": t["report"],
        "server": server,
    }
    counted = sum(v for k, v in parts.items() if k not in ("detok", "server"))
    parts["other"] = wall - counted
    parts["step"] = wall
    return {k: 1e6 * v / steps for k, v in parts.items()}


def step_alone(llm: LLM, n_seqs: int, steps: int) -> float:
    """Microseconds of one ``Context.decode`` of one token per sequence, without the engine."""
    ctx = llm.context
    for s in range(n_seqs):
        ctx.memory.seq_rm(s, -1, -1)
    ctx.decode(_prompts(n_seqs))
    pos = 4
    t0 = time.perf_counter()
    for _ in range(steps):
        ctx.decode(_one_token_each(n_seqs, pos))
        pos += 1
    elapsed = time.perf_counter() - t0
    for s in range(n_seqs):
        ctx.memory.seq_rm(s, -1, -1)
    return 1e6 * elapsed / steps


def _prompts(n_seqs: int) -> Batch:
    tokens, pos, seqs, logits = [], [], [], []
    for s in range(n_seqs):
        for j in range(4):
            tokens.append(1 + j)
            pos.append(j)
            seqs.append([s])
            logits.append(j == 3)
    return Batch(tokens, pos=pos, seq_ids=seqs, logits=logits)


def _one_token_each(n_seqs: int, pos: int) -> Batch:
    return Batch(
        [5] * n_seqs, pos=[pos] * n_seqs, seq_ids=[[s] for s in range(n_seqs)], logits=[True] * n_seqs
    )


def load(name: str, folder: Path, threads: int, n_seq_max: int) -> tuple[LLM, int | None]:
    if name == "embedded":
        llm = LLM(n_seq_max=n_seq_max, n_threads=threads)
        return llm, None
    if name == "mamba2-130m":
        from transformers import Mamba2ForCausalLM

        from throughput import hf_config

        gguf = folder / "mamba2-f32.gguf"
        if not gguf.exists():
            torch.manual_seed(0)
            Mamba2ForCausalLM(hf_config("mamba2")).save_pretrained(folder / "mamba2-hf")
            rsmem.convert(folder / "mamba2-hf", gguf, "f32")
        from rsmem.loaders import load_model

        model = load_model(gguf, n_threads=threads)
        llm = LLM(model, n_seq_max=n_seq_max, n_threads=threads)
        return llm, model.n_vocab
    raise SystemExit(f"unknown model {name!r}: embedded, mamba2-130m")


def fmt_us(values: list[float]) -> str:
    med = statistics.median(values)
    return f"{med:,.0f} ({min(values):,.0f}-{max(values):,.0f})" if len(values) > 1 else f"{med:,.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="embedded,mamba2-130m")
    ap.add_argument("--seqs", default="1,8,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sampling", default="greedy,sampled", help="greedy, sampled or both")
    args = ap.parse_args()
    seqs = [int(s) for s in args.seqs.split(",")]
    modes = {"greedy": SamplingParams(temperature=0.0), "sampled": SamplingParams(**SAMPLED)}
    chosen = [m for m in args.sampling.split(",") if m]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            llm, vocab = load(name, Path(tmp), args.threads, max(seqs))
            timers = Timers()
            llm._bench_timers = timers  # type: ignore[attr-defined]
            instrument(llm, timers)
            for mode in chosen:
                print(f"\n### {name}, {mode}: microseconds a decode step (median, lowest-highest round)\n")
                cols = ["seqs", *PARTS, "engine step", "step alone", "outside model", "tok/s"]
                print("| " + " | ".join(cols) + " |")
                print("|" + "---|" * len(cols))
                for n in seqs:
                    rounds: dict[str, list[float]] = defaultdict(list)
                    for _ in range(args.rounds):  # interleaved: engine round, then the bare step
                        r = engine_round(llm, n, modes[mode], args.steps, vocab)
                        for k, v in r.items():
                            rounds[k].append(v)
                        rounds["alone"].append(step_alone(llm, n, args.steps))
                        rounds["outside"].append(100 * (1 - r["model"] / r["step"]))
                        rounds["tok_s"].append(1e6 * n / r["step"])
                    row = [str(n), *(fmt_us(rounds[p]) for p in PARTS), fmt_us(rounds["step"])]
                    row += [fmt_us(rounds["alone"])]
                    out = rounds["outside"]
                    row += [f"{statistics.median(out):.0f}% ({min(out):.0f}-{max(out):.0f})"]
                    row += [fmt_us(rounds["tok_s"])]
                    print("| " + " | ".join(row) + " |", flush=True)


if __name__ == "__main__":
    main()
