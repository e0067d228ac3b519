"""The engine thread's CPU per output token, by stage, on bench/server_vs_llamaserver.py's workloads.

The workloads run on an ``Engine`` configured as ``rsmem serve`` configures it (4 slots, prefix cache,
checkpoints every 256 tokens, the decode step compiled), driven directly, with no HTTP: (a) 3
conversations x 5 turns at once (the chat template, message boundaries and stop string of the server;
each turn appends the answer), (b) 64 prompts of 8..1024 tokens queued at once. Stages are timed by this
thread's CPU clock (``time.thread_time``) around the functions named, so other processes on a loaded
machine change the figures less than wall time would; each figure is CPU ms per generated token, summed
over ``--rounds`` rounds after a warm-up round.

    python bench/server_engine_profile.py [--workload a|b] [--rounds 2] [--threads 1]
"""

from __future__ import annotations

import argparse
import bisect
import functools
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from rsmem.context import Context
from rsmem.engine import LLM, Engine, IncrementalDetokenizer, Sampler, SamplingParams, default_model_path
from rsmem.engine import engine as engine_module
from rsmem.engine.checkpoints import CheckpointCache
from rsmem.memory import checkpoint
from rsmem.models.mamba.base import MambaFamilyModel
from rsmem.server.chat import ChatTemplate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from server_vs_llamaserver import QUESTIONS, STOP, Texts

STAGES = [  # (owner, attribute, stage)
    (Engine, "step", "step"),
    (Context, "decode", "context"),
    (MambaFamilyModel, "forward", "model"),
    (MambaFamilyModel, "decode_forward", "compiled decode"),
    (Sampler, "sample", "sampling"),
    (IncrementalDetokenizer, "push", "detokenize"),
    (engine_module, "report", "reports"),
    (CheckpointCache, "add", "checkpoints"),  # finiteness check, insertion
    (checkpoint, "take", "checkpoints"),  # a copy of a finished request's state
    (CheckpointCache, "restore_best", "restore"),
    (Engine, "add_request", "add_request"),
]


def wrap(spent: dict[str, float], owner: Any, attr: str, stage: str) -> None:
    original: Callable[..., Any] = getattr(owner, attr)

    @functools.wraps(original)
    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return original(*args, **kwargs)
        finally:
            spent[stage] = spent.get(stage, 0.0) + time.thread_time() - t0

    setattr(owner, attr, timed)


def chat(engine: Engine, llm: LLM, system: str) -> int:
    """Workload (a); returns the tokens generated."""
    tok, template = llm.tokenizer, ChatTemplate()
    assert tok is not None
    convs = [[{"role": "system", "content": system}] for _ in range(3)]
    turns, live, generated = [0, 0, 0], {}, 0

    def submit(k: int) -> None:
        convs[k].append({"role": "user", "content": f"{QUESTIONS[(k + turns[k]) % 5]} ({k}.{turns[k]})"})
        ids, ends = tok.encode_with_ends(template.render(convs[k]))
        bounds = [bisect.bisect_right(ends, len(p)) for p in template.message_prefixes(convs[k])]
        params = SamplingParams(max_tokens=32, temperature=0, seed=1, stop=tuple(STOP))
        live[engine.add_request(ids, params, boundaries=bounds)] = k

    for k in range(3):
        submit(k)
    while live:
        for out in engine.step():
            if out.finished:
                k = live.pop(out.request_id)
                generated += len(out.outputs[0].token_ids)
                convs[k].append({"role": "assistant", "content": out.outputs[0].text})
                turns[k] += 1
                if turns[k] < 5:
                    submit(k)
    return generated


def completions(engine: Engine, texts: Texts) -> int:
    """Workload (b); returns the tokens generated."""
    lengths = [round(8 * (1024 / 8) ** (i / 63)) for i in range(64)]
    random.Random(7).shuffle(lengths)
    params = SamplingParams(max_tokens=32, temperature=0, seed=1, stop=tuple(STOP))
    for i, n in enumerate(lengths):
        engine.add_request(texts.of(n, 97 * i), params)
    return sum(len(o.outputs[0].token_ids) for o in engine.run_until_done() if o.finished)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=["a", "b"], default="a")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    llm = LLM(default_model_path(), n_seq_max=4, n_batch=512, n_threads=args.threads, compile="1")
    llm.model.warm_up()  # type: ignore[operator]
    texts = Texts(default_model_path())
    system = texts.words(400)

    def engine() -> Engine:
        return Engine(
            llm.context,
            llm.tokenizer,
            prompt_cache=True,
            max_prompt_tokens=8192,
            cache_bytes=1024 << 20,
            checkpoint_interval=256,
        )

    def run(e: Engine) -> int:
        return chat(e, llm, system) if args.workload == "a" else completions(e, texts)

    run(engine())  # warm-up
    spent: dict[str, float] = {}
    for owner, attr, stage in STAGES:
        wrap(spent, owner, attr, stage)
    generated, cpu, computed, cached = 0, 0.0, 0, 0
    for _ in range(args.rounds):
        e = engine()
        t0 = time.thread_time()
        generated += run(e)
        cpu += time.thread_time() - t0
        computed += e.stats.prompt_tokens
        cached += e.stats.cached_prompt_tokens

    def ms(*stages: str) -> float:
        return sum(spent.get(s, 0.0) for s in stages) / generated * 1e3

    inner = ("context", "sampling", "detokenize", "reports", "checkpoints", "restore")
    rows = [
        ("engine thread, all", cpu / generated * 1e3),
        ("engine step", ms("step")),
        ("  Context.decode", ms("context")),
        ("    the model", ms("model")),
        ("      compiled decode steps", ms("compiled decode")),
        ("      prompt chunks (eager)", ms("model") - ms("compiled decode")),
        ("    around the model (batch, memory slots, logits)", ms("context") - ms("model")),
        ("  sampling", ms("sampling")),
        ("  detokenizing", ms("detokenize")),
        ("  reports", ms("reports")),
        ("  prefix cache: checkpoints kept", ms("checkpoints")),
        ("  prefix cache: restores", ms("restore")),
        ("  the rest (admit, plan, batch, commit, stop strings, ends)", ms("step") - ms(*inner)),
        ("add_request (tokenize, validate)", ms("add_request")),
    ]
    print(f"workload {args.workload}: {generated} tokens in {args.rounds} rounds, {args.threads} thread(s)")
    print(f"prompt tokens a round: {computed // args.rounds} computed, {cached // args.rounds} from caches")
    print("| engine thread, CPU ms per output token | ms |\n|---|---|")
    for name, value in rows:
        print(f"| {name} | {value:.3f} |")


if __name__ == "__main__":
    main()
