"""Where one engine step of several decoding sequences goes: the model, the context around it, the engine.

An ``Engine`` as ``rsmem serve`` makes it (prompt cache, checkpoints) decodes N sequences; each stage is
timed by the CPU time of this thread (``time.thread_time``), so other processes on a loaded machine change
the figures less than wall time would. Stages: the model's forward (inside it the matrix products, which
are timed separately when they are oneDNN's), ``Context.decode`` around it (batch split, memory slots,
state moves, logits), and the rest of ``Engine.step`` (scheduling, batch building, sampling,
detokenizing, reports).

    python bench/server_step_profile.py [--model PATH] [--widths 1,2,4,8] [--steps 200] [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from rsmem.context import Context
from rsmem.engine import Engine, SamplingParams, default_model_path
from rsmem.engine.llm import load_text_model


class Timer:
    """CPU time spent inside wrapped callables, by stage."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}

    def wrap(self, owner: Any, attr: str, stage: str) -> None:
        original: Callable[..., Any] = getattr(owner, attr)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.spent[stage] = self.spent.get(stage, 0.0) + time.thread_time() - t0

        setattr(owner, attr, timed)


def profile(model: Any, tokenizer: Any, width: int, steps: int) -> dict[str, float]:
    ctx = Context(model, n_seq_max=max(width, 2))
    engine = Engine(ctx, tokenizer, prompt_cache=True, cache_bytes=64 << 20, checkpoint_interval=256)
    params = SamplingParams(max_tokens=steps + 40, temperature=0.8, top_k=40, top_p=0.95, ignore_eos=True)
    for k in range(width):
        engine.add_request(f"ROMEO {k}: what news?", params)
    for _ in range(20):  # prompts in, decoding
        engine.step()
    timer = Timer()
    timer.wrap(model, "forward", "model")
    timer.wrap(ctx, "decode", "context")
    products = torch.ops.mkldnn._linear_pointwise
    counted = Timer()

    def product(*args: Any) -> Any:
        t0 = time.thread_time()
        try:
            return products(*args)
        finally:
            counted.spent["products"] = counted.spent.get("products", 0.0) + time.thread_time() - t0

    torch.ops.mkldnn._linear_pointwise = product  # type: ignore[assignment]
    per_step = []
    try:
        t_all = time.thread_time()
        for _ in range(steps):
            t0 = time.thread_time()
            engine.step()
            per_step.append(time.thread_time() - t0)
        total = time.thread_time() - t_all
    finally:
        torch.ops.mkldnn._linear_pointwise = products  # type: ignore[assignment]
    del model.forward  # the wrapper was set on the instance
    spent = {k: v / steps * 1e3 for k, v in timer.spent.items()}
    prods = counted.spent.get("products", 0.0) / steps * 1e3
    return {
        "step p50": statistics.median(per_step) * 1e3,
        "step mean": total / steps * 1e3,
        "model": spent["model"],
        "  of it products": prods,
        "context around the model": spent["context"] - spent["model"],
        "engine around the context": total / steps * 1e3 - spent["context"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=str(default_model_path()))
    ap.add_argument("--widths", default="1,2,4,8")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--compile", default="1")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_text_model(args.model, compile=args.compile, n_threads=args.threads)
    model.warm_up()
    widths = [int(w) for w in args.widths.split(",")]
    rows = {w: profile(model, tokenizer, w, args.steps) for w in widths}
    print("| CPU ms a step | " + " | ".join(f"{w} seq" for w in widths) + " |")
    print("|---|" + "---|" * len(widths))
    for key in next(iter(rows.values())):
        print(f"| {key} | " + " | ".join(f"{rows[w][key]:.2f}" for w in widths) + " |")


if __name__ == "__main__":
    main()
