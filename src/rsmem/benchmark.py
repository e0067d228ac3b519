"""Tokens per second of a model on a Context: prefill, and decode with several parallel sequences."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rsmem.batch.batch import Batch
from rsmem.context import Context
from rsmem.models.protocol import RecurrentModel


@dataclass(frozen=True, slots=True)
class Throughput:
    name: str
    prefill_tokens: int
    prefill_tok_s: float
    decode_tok_s: dict[int, float]  # parallel sequences -> tokens per second (all sequences together)


def measure(
    model: RecurrentModel,
    name: str,
    *,
    n_prompt: int = 512,
    parallel: tuple[int, ...] = (1, 8),
    steps: int = 16,
    progress: Callable[[str], None] | None = None,
) -> Throughput:
    """Prefill ``n_prompt`` tokens in one sequence, then time ``steps`` decode steps per parallel count."""
    g = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, model.n_vocab, (n_prompt,), generator=g).tolist()
    ctx = Context(model, n_seq_max=max(parallel), n_batch=max(n_prompt, 512), n_ubatch=512)
    ctx.decode(Batch(prompt[:16]))  # warm-up
    ctx.memory.clear()
    if progress:
        progress(f"{name}: prefill {n_prompt} tokens")
    t0 = time.perf_counter()
    ctx.decode(Batch(prompt))
    prefill = n_prompt / (time.perf_counter() - t0)
    decode: dict[int, float] = {}
    for n in parallel:
        if progress:
            progress(f"{name}: decode, {n} sequences")
        ctx.memory.clear()
        ctx.decode(Batch.from_sequences({s: prompt[:4] for s in range(n)}))
        step = Batch.from_sequences({s: [prompt[s]] for s in range(n)})
        ctx.decode(step)  # warm-up at this width
        t0 = time.perf_counter()
        for _ in range(steps):
            ctx.decode(step)
        decode[n] = n * steps / (time.perf_counter() - t0)
    return Throughput(name, n_prompt, prefill, decode)


def format_table(results: list[Throughput]) -> str:
    parallel = sorted({n for r in results for n in r.decode_tok_s})
    head = f"{'model':<28} {'prefill tok/s':>14}" + "".join(f" {f'decode x{n} tok/s':>17}" for n in parallel)
    lines = [head, "-" * len(head)]
    for r in results:
        cells = "".join(f" {r.decode_tok_s.get(n, float('nan')):>17.1f}" for n in parallel)
        lines.append(f"{r.name:<28} {r.prefill_tok_s:>14.1f}{cells}")
    return "\n".join(lines)
