"""The prefix cache against the exact-extension cache and no cache, through ``/v1/chat/completions``.

Three servers over the same model, run one after another in interleaved rounds (same seeds, greedy,
so the same outputs): ``none`` (``--no-prompt-cache``), ``extension`` (a slot's state serves only a
prompt that extends its exact tokens: ``--cache-ram 0``) and ``checkpoints`` (the prefix cache).
Workloads:

- ``chat``: C conversations x T turns sharing a long system prompt; each turn re-sends the whole
  conversation as text (as chat clients do) and the model's answer is re-tokenised from text;
- ``regenerate``: the same, and each turn is also asked again (a user pressing "regenerate");
- ``fanout``: B branches from one long context, each adding a different question.

Reported per server: prompt tokens computed (not served from a cache), the share of re-sent prompt
tokens served from a cache from the second turn on, TTFT p50/p99 (streamed), TTFT of the last turn over
the second, and the cache's bytes.

Each round runs every server once on every workload, one after another, so rounds interleave the
servers; the table gives the median over rounds with the worst round, and the TTFT ratio of each server
to ``none`` as the median of per-round ratios with its worst round.

Models: ``embedded`` (the packaged Shakespeare model, Mamba-2 d_model 256) or ``130m`` (a random
Mamba-2 of the 130M class, d_model 768, 24 layers, with the embedded tokenizer's 4,096 tokens).

Run: .venv/bin/python bench/prefix_cache.py [--model embedded|130m] [--rounds 3] [--conversations 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from dataclasses import dataclass, field

import httpx
import uvicorn

from rsmem.engine import LLM, SamplingParams, default_model_path
from rsmem.models import Mamba2Config
from rsmem.models.mamba.random_init import random_mamba2
from rsmem.server import ServeOptions, build_app

SENTENCE = "Now is the winter of our discontent made glorious summer by this sun of York. "
QUESTIONS = ["Who art thou?", "Whence comest thou?", "What news?", "Why weep you?", "Where is the king?"]
SERVERS = {
    "none": {"no_prompt_cache": True},
    "extension": {"cache_ram": 0},
    "checkpoints": {},
}


@dataclass
class Tally:
    ttft: list[float] = field(default_factory=list)
    ttft_by_turn: dict[int, list[float]] = field(default_factory=dict)
    prompt: int = 0
    cached: int = 0
    resent: int = 0  # prompt tokens of turns >= 2 that the previous turn also sent
    resent_cached: int = 0
    texts: dict[tuple, str] = field(default_factory=dict)  # every answer, by (conversation, turn, ask)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def ask(client: httpx.AsyncClient, url: str, messages: list[dict], max_tokens: int) -> tuple:
    body = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    t0, ttft, text, usage = time.perf_counter(), None, "", {}
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", []):
                if choice["delta"].get("content"):
                    ttft = ttft or time.perf_counter() - t0
                    text += choice["delta"]["content"]
    return ttft or time.perf_counter() - t0, text, usage


def record(tally: Tally, turn: int, ttft: float, usage: dict, previous_prompt: int) -> None:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    tally.ttft.append(ttft)
    tally.ttft_by_turn.setdefault(turn, []).append(ttft)
    tally.prompt += usage["prompt_tokens"]
    tally.cached += cached
    if turn >= 1:
        tally.resent += previous_prompt
        tally.resent_cached += min(cached, previous_prompt)


async def conversation(client, url, k: int, turns: int, system: str, tally: Tally, regenerate: bool):
    messages = [{"role": "system", "content": system}]
    previous = 0
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{QUESTIONS[(k + turn) % len(QUESTIONS)]} ({k}.{turn})"})
        ttft, text, usage = await ask(client, url, messages, 12)
        record(tally, turn, ttft, usage, previous)
        tally.texts[(k, turn, 0)] = text
        if regenerate:
            ttft, text, usage = await ask(client, url, messages, 12)
            record(tally, turn, ttft, usage, usage["prompt_tokens"])
            tally.texts[(k, turn, 1)] = text
        previous = usage["prompt_tokens"]
        messages.append({"role": "assistant", "content": text})


async def fanout(client, url, branches: int, context: str, tally: Tally) -> None:
    base = [{"role": "system", "content": context}, {"role": "user", "content": "Tell the tale."}]
    ttft, text, usage = await ask(client, url, base, 12)
    record(tally, 0, ttft, usage, 0)
    tally.texts[(0, 0, 0)] = text
    shared = [*base, {"role": "assistant", "content": text}]
    for b in range(branches):
        ttft, answer, usage = await ask(
            client, url, [*shared, {"role": "user", "content": QUESTIONS[b % 5]}], 12
        )
        record(tally, 1, ttft, usage, usage["prompt_tokens"])
        tally.texts[(b, 1, 0)] = answer


def serve(llm: LLM, options: dict):
    served = build_app(llm, ServeOptions(max_tokens_limit=64, max_prompt_tokens=8192, **options))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(served.app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    return f"http://127.0.0.1:{port}", server, thread, served


async def run_workload(url: str, workload: str, args, system: str) -> Tally:
    tally = Tally()
    async with httpx.AsyncClient(timeout=600) as client:
        if workload == "fanout":
            await fanout(client, url, args.branches, system, tally)
        else:
            sem = asyncio.Semaphore(args.parallel)

            async def one(k: int) -> None:
                async with sem:
                    await conversation(client, url, k, args.turns, system, tally, workload == "regenerate")

            await asyncio.gather(*(one(k) for k in range(args.conversations)))
    return tally


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else xs[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conversations", type=int, default=16)
    ap.add_argument("--turns", type=int, default=8)
    ap.add_argument("--branches", type=int, default=8)
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--system-words", type=int, default=600, help="~1.6 tokens a word with the default model")
    ap.add_argument("--workloads", nargs="+", default=["chat", "regenerate", "fanout"])
    ap.add_argument("--servers", nargs="+", default=list(SERVERS), choices=list(SERVERS))
    ap.add_argument("--by-turn", action="store_true", help="also print the median TTFT of each turn")
    ap.add_argument("--model", choices=["embedded", "130m"], default="embedded")
    args = ap.parse_args()
    llm = LLM(default_model_path(), n_seq_max=args.parallel, n_batch=512)
    if args.model == "130m":
        cfg = Mamba2Config(d_model=768, n_layer=24, n_vocab=4096, d_state=128, n_head=24, n_group=1)
        llm = LLM(random_mamba2(cfg, seed=0), tokenizer=llm.tokenizer, n_seq_max=args.parallel, n_batch=512)
    llm.generate("warm up", SamplingParams.greedy(max_tokens=4))  # compiles the decode steps, if they compile
    llm.context.memory.clear()
    words = SENTENCE.split()
    system = " ".join(words[i % len(words)] for i in range(args.system_words))
    results: dict[tuple[str, str], list[tuple[Tally, int]]] = {}
    for r in range(args.rounds):
        for workload in args.workloads:
            for name in args.servers:
                options = SERVERS[name]
                url, server, thread, served = serve(llm, options)
                try:
                    tally = asyncio.run(run_workload(url, workload, args, system))
                    snap = served.runner.engine.snapshot()
                    results.setdefault((workload, name), []).append((tally, snap.cache_bytes))
                finally:
                    server.should_exit = True
                    thread.join(timeout=30)
                    served.runner.stop()
                    llm.context.memory.clear()
                print(f"round {r + 1}: {workload:<10} {name:<11} done", flush=True)
    print(
        "\n| workload | server | prompt tokens computed | re-sent from cache | TTFT p50 | TTFT p99 "
        "| TTFT last/2nd turn | cache MB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (workload, name), runs in results.items():
        computed = [t.prompt - t.cached for t, _ in runs]
        share = [t.resent_cached / t.resent if t.resent else 0.0 for t, _ in runs]
        p50 = [pct(t.ttft, 50) for t, _ in runs]
        p99 = [pct(t.ttft, 99) for t, _ in runs]
        turns = sorted(runs[0][0].ttft_by_turn)
        ratio = [
            statistics.median(t.ttft_by_turn[turns[-1]]) / statistics.median(t.ttft_by_turn[turns[1]])
            for t, _ in runs
            if len(turns) > 1
        ]
        mb = max(b for _, b in runs) / 1e6
        print(
            f"| {workload} | {name} | {statistics.median(computed):.0f} ({min(computed)}-{max(computed)}) "
            f"| {statistics.median(share):.1%} (min {min(share):.1%}) "
            f"| {statistics.median(p50) * 1e3:.0f} ms (max {max(p50) * 1e3:.0f}) "
            f"| {statistics.median(p99) * 1e3:.0f} ms (max {max(p99) * 1e3:.0f}) "
            f"| {statistics.median(ratio) if ratio else float('nan'):.2f} | {mb:.1f} |"
        )
    print_ratios(results, args)
    first = args.servers[0]
    for (workload, name), runs in results.items():
        same = [
            t.texts == base.texts for (t, _), (base, _) in zip(runs, results[(workload, first)], strict=True)
        ]
        print(f"{workload} {name}: answers identical to {first}'s in {sum(same)} of {len(same)} rounds")
    if args.by_turn:
        for (workload, name), runs in results.items():
            turns = sorted(runs[0][0].ttft_by_turn)
            by_turn = {k: statistics.median(x for t, _ in runs for x in t.ttft_by_turn[k]) for k in turns}
            print(workload, name, " ".join(f"{k + 1}:{v * 1e3:.0f}ms" for k, v in by_turn.items()))


def print_ratios(results: dict[tuple[str, str], list[tuple[Tally, int]]], args) -> None:
    """Per workload and server: TTFT p50 and p99 over ``none``'s in the same round (median of rounds,
    worst round in brackets) and the turn-8/turn-2 ratio per round."""
    if "none" not in args.servers:
        return
    print("\n| workload | server | TTFT p50 / none | TTFT p99 / none | last/2nd turn by round |")
    print("|---|---|---|---|---|")
    for (workload, name), runs in results.items():
        if name == "none":
            continue
        base = results[(workload, "none")]
        r50 = [pct(t.ttft, 50) / pct(b.ttft, 50) for (t, _), (b, _) in zip(runs, base, strict=True)]
        r99 = [pct(t.ttft, 99) / pct(b.ttft, 99) for (t, _), (b, _) in zip(runs, base, strict=True)]
        turns = sorted(runs[0][0].ttft_by_turn)
        last = [
            statistics.median(t.ttft_by_turn[turns[-1]]) / statistics.median(t.ttft_by_turn[turns[1]])
            for t, _ in runs
            if len(turns) > 1
        ]
        print(
            f"| {workload} | {name} | {statistics.median(r50):.2f} (worst {max(r50):.2f}) "
            f"| {statistics.median(r99):.2f} (worst {max(r99):.2f}) | {' '.join(f'{x:.2f}' for x in last)} |"
        )


if __name__ == "__main__":
    main()
