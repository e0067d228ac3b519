"""Constrained against free generation: tokens/s, mask time per token, the share of tokens forced, validity.

    python bench/structured.py [--models embedded,mamba2-130m] [--seqs 1,8,64] [--rounds 3] [--threads 2]

For each model and number of sequences, ``seqs`` requests run together, each constrained to a schema of
the corpus ``tests/fixtures/structured/schemas.json`` (cycled), greedy, at most ``--max-tokens`` tokens:

- ``constrained``: the engine as it is (a completion decoding alone gets its forced runs in one chunk);
- ``no forced runs``: the same requests with forced runs off (every token sampled in its own step);
- ``free``: the same prompts unconstrained, each made to generate exactly as many tokens as its
  constrained answer (``ignore_eos``), so the rows compare the same amount of text.

Columns: tokens/s end to end (median over rounds, the lowest round in brackets), engine steps, the mask's
microseconds per masked token (llguidance's masks of a step's constrained rows together, unpacking and
``-inf`` fill), the share of tokens forced (appended without sampling), and the share of answers that
ended with ``stop`` and validate against their schema with ``jsonschema``. ``mamba2-130m`` is a random
130M Mamba-2 (transformers' config) given the embedded model's tokenizer (its other ids are never allowed).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

# isort: off
import rsmem  # first: it sets OpenMP's wait policy before torch loads (rsmem.threads)
import torch

# isort: on

import jsonschema

import rsmem.engine.constraints as constraints
from rsmem.engine import LLM, SamplingParams
from rsmem.engine.constraints import Constraint

CORPUS = Path(__file__).parents[1] / "tests" / "fixtures" / "structured" / "schemas.json"
PROMPT = "ROMEO:"


class MaskTimer:
    """Wraps ``constraints.allowed_tokens`` (the masks) with a timer and a row count."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.rows = 0
        self._inner = constraints.allowed_tokens

    def __call__(self, matchers: Any, n_vocab: int) -> Any:
        t0 = time.perf_counter()
        out = self._inner(matchers, n_vocab)
        self.seconds += time.perf_counter() - t0
        self.rows += len(matchers)
        return out


def run(llm: LLM, params: list[SamplingParams], forced: bool) -> tuple[float, int, list[Any], MaskTimer]:
    builder = llm.engine.builder.constraints
    saved = builder.forced_run
    builder.forced_run = saved if forced else 0  # read by every compile, cached or not
    timer = MaskTimer()
    constraints.allowed_tokens = timer  # type: ignore[assignment]
    steps = llm.engine.stats.steps
    try:
        t0 = time.perf_counter()
        outs = llm.generate([PROMPT] * len(params), params)
        elapsed = time.perf_counter() - t0
    finally:
        constraints.allowed_tokens = timer._inner
        builder.forced_run = saved
    return elapsed, llm.engine.stats.steps - steps, outs, timer


def load(name: str, folder: Path, threads: int, n_seq_max: int) -> LLM:
    embedded = LLM(n_seq_max=n_seq_max, n_threads=threads, n_batch=max(512, 8 * n_seq_max))
    if name == "embedded":
        return embedded
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
        return LLM(
            model,
            tokenizer=embedded.tokenizer,
            n_seq_max=n_seq_max,
            n_threads=threads,
            n_batch=max(512, 8 * n_seq_max),
        )
    raise SystemExit(f"unknown model {name!r}: embedded, mamba2-130m")


def fmt(values: list[float], digits: int = 0) -> str:
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="embedded")
    ap.add_argument("--seqs", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    args = ap.parse_args()
    corpus = json.loads(CORPUS.read_text())
    print("| model | seqs | row | tokens/s | steps | mask us/token | forced | valid |")
    print("|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            for n in map(int, args.seqs.split(",")):
                llm = load(name, Path(tmp), args.threads, n)
                entries = [corpus[i % len(corpus)] for i in range(n)]
                params = [
                    SamplingParams.greedy(
                        max_tokens=args.max_tokens, constraint=Constraint.json_schema(e["schema"])
                    )
                    for e in entries
                ]
                llm.generate([PROMPT] * n, params)  # warm-up: kernels, compiled schemas
                rows: dict[str, dict[str, list[float]]] = {}
                for _ in range(args.rounds):
                    for row, forced in (("constrained", True), ("no forced runs", False)):
                        elapsed, steps, outs, timer = run(llm, params, forced)
                        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                        valid = 0
                        for e, o in zip(entries, outs, strict=True):
                            if o.outputs[0].finish_reason.value == "stop":
                                jsonschema.validate(json.loads(o.text), e["schema"])
                                valid += 1
                        r = rows.setdefault(row, {k: [] for k in ("tps", "steps", "mask", "forced", "valid")})
                        r["tps"].append(tokens / elapsed)
                        r["steps"].append(steps)
                        r["mask"].append(1e6 * timer.seconds / max(1, timer.rows))
                        r["forced"].append(1 - timer.rows / tokens)
                        r["valid"].append(valid / n)
                    lengths = [len(o.outputs[0].token_ids) for o in outs]
                    free = [SamplingParams.greedy(max_tokens=k, ignore_eos=True) for k in lengths]
                    elapsed, steps, outs, _ = run(llm, free, True)
                    r = rows.setdefault("free", {k: [] for k in ("tps", "steps")})
                    r["tps"].append(sum(lengths) / elapsed)
                    r["steps"].append(steps)
                for row, r in rows.items():
                    cells = [fmt(r["tps"]), f"{statistics.median(r['steps']):.0f}"]
                    if "mask" in r:
                        cells += [
                            fmt(r["mask"]),
                            f"{statistics.median(r['forced']):.0%}",
                            f"{statistics.median(r['valid']):.0%}",
                        ]
                    else:
                        cells += ["-", "-", "-"]
                    print(f"| {name} | {n} | {row} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
