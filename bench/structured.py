"""Constrained against free generation, in the engine and against llama-server: tokens/s, mask time per
token, the share of tokens forced, validity.

    python bench/structured.py [--parts engine,servers] [--models embedded,mamba2-130m] [--seqs 1,8,64]
                               [--rounds 3] [--threads 2] [--rows constrained,no-forced,free]
                               [--kinds json_schema,grammar,tools]

``engine`` (in process, no server): for each model and number of sequences, ``seqs`` requests run
together, each constrained to a schema of the corpus ``tests/fixtures/structured/schemas.json`` (cycled),
greedy, at most ``--max-tokens`` tokens:

- ``constrained``: the engine as it is (a completion decoding alone gets its forced runs in one chunk);
- ``no-forced``: the same requests with forced runs off (every token sampled in its own step);
- ``free``: the same prompts unconstrained, each made to generate exactly as many tokens as its
  constrained answer (``ignore_eos``), so the rows compare the same amount of text.

Rows alternate their order from round to round. Columns: tokens/s end to end (median over rounds, the
lowest round in brackets), the ratio to ``free`` (median of the per-round ratios, the lowest round in
brackets), engine steps, the mask's microseconds per masked token (llguidance's masks of a step's
constrained rows together, unpacking and ``-inf`` fill), the share of tokens forced (appended without
sampling), and the share of answers that ended with ``stop`` and validate against their schema with
``jsonschema``.

``servers``: ``rsmem serve`` and llama-server (b11312, bench/llamaserver_build.py) run at once on the same
GGUF, each with ``max(seqs)`` slots and ``--threads`` threads, llama-server with ``--jinja``. The GGUF is
the model with tests/server/test_tool_templates.py's cut-down Qwen 2.5 (Hermes ``<tool_call>``) chat
template added, so both render tools the same way. Kinds of request, the same bodies to both:
``json_schema`` (``/v1/completions`` with llama-server's ``json_schema`` field, the corpus's schemas),
``grammar`` (``/v1/completions`` with a GBNF ``grammar`` whose answers are JSON) and ``tools``
(``/v1/chat/completions`` with three tools, ``tool_choice: "required"``, ``parallel_tool_calls: false``).
At each concurrency C, ``max(C, 8)`` requests, C at a time, greedy; tokens/s is the completion tokens
(``usage``) over the wall time; rounds alternate which server goes first. Each answer is judged: valid
(it parses and validates with ``jsonschema``: the schema, the grammar's schema, or each call's function
``parameters``), cut (``finish_reason: "length"``), invalid (it stopped and does not parse or validate:
an unconstrained answer to a constrained request) or refused (not 200).

``mamba2-130m`` is a random 130M Mamba-2 (bench/throughput.py's config) with the embedded model's
tokenizer, padded to its vocabulary (bench/server_vs_llamaserver.py's ``random_130m_gguf``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

# isort: off
import rsmem  # noqa: F401  first: it sets OpenMP's wait policy before torch loads (rsmem.threads)
import torch  # noqa: F401

# isort: on

import jsonschema

import rsmem.engine.constraints as constraints
from rsmem.engine import LLM, SamplingParams
from rsmem.engine.constraints import Constraint

sys.path.insert(0, str(Path(__file__).resolve().parent))

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


def load(name: str, threads: int, n_seq_max: int) -> LLM:
    if name == "embedded":
        path = None
    elif name == "mamba2-130m":
        from server_vs_llamaserver import random_130m_gguf

        path = random_130m_gguf("mamba2")
    else:
        raise SystemExit(f"unknown model {name!r}: embedded, mamba2-130m")
    return LLM(path, n_seq_max=n_seq_max, n_threads=threads, n_batch=max(512, 8 * n_seq_max))


def fmt(values: list[float], digits: int = 0) -> str:
    return f"{statistics.median(values):,.{digits}f} ({min(values):,.{digits}f})"


def engine(args: argparse.Namespace, corpus: list[dict[str, Any]]) -> None:
    print("| model | seqs | row | tokens/s | / free | steps | mask us/token | forced | valid |")
    print("|---|---|---|---|---|---|---|---|---|")
    wanted = args.rows.split(",")
    for name in args.models.split(","):
        for n in map(int, args.seqs.split(",")):
            llm = load(name, args.threads, n)
            entries = [corpus[i % len(corpus)] for i in range(n)]
            params = [
                SamplingParams.greedy(
                    max_tokens=args.max_tokens, constraint=Constraint.json_schema(e["schema"])
                )
                for e in entries
            ]
            outs = llm.generate([PROMPT] * n, params)  # warm-up: kernels, compiled schemas; the lengths
            lengths = [len(o.outputs[0].token_ids) for o in outs]
            free = [SamplingParams.greedy(max_tokens=k, ignore_eos=True) for k in lengths]
            llm.generate([PROMPT] * n, free)
            rows: dict[str, dict[str, list[float]]] = {r: {} for r in wanted}
            for k in range(args.rounds):
                for row in wanted if k % 2 == 0 else wanted[::-1]:
                    r = rows[row]
                    if row == "free":
                        elapsed, steps, outs, timer = run(llm, free, True)
                    else:
                        elapsed, steps, outs, timer = run(llm, params, row == "constrained")
                    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                    valid = 0
                    for e, o in zip(entries, outs, strict=True):
                        if row != "free" and o.outputs[0].finish_reason.value == "stop":
                            jsonschema.validate(json.loads(o.text), e["schema"])
                            valid += 1
                    for key, value in (
                        ("tps", tokens / elapsed),
                        ("steps", steps),
                        ("mask", 1e6 * timer.seconds / max(1, timer.rows)),
                        ("forced", 1 - timer.rows / tokens),
                        ("valid", valid / n),
                    ):
                        r.setdefault(key, []).append(value)
            for row, r in rows.items():
                cells = [fmt(r["tps"])]
                if "free" in rows:
                    ratios = [a / b for a, b in zip(r["tps"], rows["free"]["tps"], strict=True)]
                    cells.append(f"{statistics.median(ratios):.2f} ({min(ratios):.2f})")
                else:
                    cells.append("-")
                cells.append(f"{statistics.median(r['steps']):.0f}")
                if row != "free":
                    cells += [
                        fmt(r["mask"]),
                        f"{statistics.median(r['forced']):.0%}",
                        f"{statistics.median(r['valid']):.0%}",
                    ]
                else:
                    cells += ["-", "-", "-"]
                print(f"| {name} | {n} | {row} | " + " | ".join(cells) + " |", flush=True)
            del llm


# ------------------------------------------------------------------ side by side with llama-server

# A GBNF grammar both servers take, whose answers are JSON checked against GRAMMAR_SCHEMA.
GRAMMAR = r"""root ::= "{\"speaker\":\"" name "\",\"mood\":\"" mood "\",\"line\":" num "}"
name ::= [A-Z] [a-z]{1,11}
mood ::= "glad" | "sad" | "angry"
num ::= [1-9] [0-9]{0,3}"""
GRAMMAR_SCHEMA = {
    "type": "object",
    "properties": {
        "speaker": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"},
        "mood": {"enum": ["glad", "sad", "angry"]},
        "line": {"type": "integer", "minimum": 1, "maximum": 9999},
    },
    "required": ["speaker", "mood", "line"],
    "additionalProperties": False,
}
TOOLS = [
    {"name": "weather", "parameters": {"city": {"type": "string", "maxLength": 24}}},
    {
        "name": "summon",
        "parameters": {"who": {"enum": ["ROMEO", "JULIET", "NURSE"]}, "urgent": {"type": "boolean"}},
    },
    {
        "name": "count",
        "parameters": {"what": {"type": "string", "maxLength": 16}, "n": {"type": "integer", "minimum": 0}},
    },
]
TOOL_SPECS = [
    {
        "type": "function",
        "function": {
            "name": t["name"],
            "description": f"The {t['name']} tool",
            "parameters": {
                "type": "object",
                "properties": t["parameters"],
                "required": list(t["parameters"]),
                "additionalProperties": False,
            },
        },
    }
    for t in TOOLS
]
PARAMS = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SPECS}
SPEAKERS = ["ROMEO:", "JULIET:", "MERCUTIO:", "NURSE:", "TYBALT:", "FRIAR:", "CAPULET:", "BENVOLIO:"]
QUESTIONS = ["Weather in Verona?", "Call the nurse.", "How many swords?", "Is it day?"]


def hermes_gguf(source: Path, folder: Path) -> Path:
    """A copy of ``source`` with tests/server/test_tool_templates.py's cut-down Qwen 2.5 (Hermes) template:
    a template that knows tools, so that both servers render them the same way."""
    out = folder / f"{source.stem}-hermes.gguf"
    if not out.exists():
        tests = Path(__file__).parents[1] / "tests" / "server" / "test_tool_templates.py"
        found = re.search(r'QWEN = """(.*?)"""', tests.read_text(), re.S)
        assert found is not None
        (folder / "hermes.jinja").write_text(found.group(1))
        cmd = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file"]
        subprocess.run(
            [*cmd, str(folder / "hermes.jinja"), str(source), str(out)], check=True, capture_output=True
        )
    return out


def request(kind: str, i: int, max_tokens: int, corpus: list[dict[str, Any]]) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0, "seed": 1}
    if kind == "json_schema":
        return "/v1/completions", body | {
            "prompt": SPEAKERS[i % 8],
            "json_schema": corpus[i % len(corpus)]["schema"],
        }
    if kind == "grammar":
        return "/v1/completions", body | {"prompt": SPEAKERS[i % 8], "grammar": GRAMMAR}
    messages = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)] + f" ({i})"}]
    body |= {
        "messages": messages,
        "tools": TOOL_SPECS,
        "tool_choice": "required",
        "parallel_tool_calls": False,
    }
    return "/v1/chat/completions", body


def verdict(kind: str, i: int, status: int, answer: dict[str, Any], corpus: list[dict[str, Any]]) -> str:
    """``valid``; ``cut`` (max_tokens); ``refused`` (not 200); ``invalid`` (it stopped, and does not parse
    or validate: an unconstrained answer to a constrained request)."""
    if status != 200:
        return "refused"
    choice = answer["choices"][0]
    if choice["finish_reason"] == "length":
        return "cut"
    try:
        if kind == "tools":
            calls = choice["message"].get("tool_calls") or []
            if not calls:
                return "invalid"
            for call in calls:
                args = json.loads(call["function"]["arguments"])
                jsonschema.validate(args, PARAMS[call["function"]["name"]])
        else:
            schema = corpus[i % len(corpus)]["schema"] if kind == "json_schema" else GRAMMAR_SCHEMA
            jsonschema.validate(json.loads(choice["text"]), schema)
    except (ValueError, KeyError, jsonschema.ValidationError):
        return "invalid"
    return "valid"


async def wave(
    url: str, kind: str, conc: int, n_req: int, max_tokens: int, corpus: list[Any]
) -> tuple[float, Counter[str]]:
    """``n_req`` requests, ``conc`` at a time; returns completion tokens / wall time and the verdicts."""
    import httpx

    gate = asyncio.Semaphore(conc)
    tokens = 0
    verdicts: Counter[str] = Counter()
    limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=900, limits=limits) as client:

        async def one(i: int) -> None:
            nonlocal tokens
            path, body = request(kind, i, max_tokens, corpus)
            async with gate:
                r = await client.post(url + path, json=body)
            answer = r.json()
            if r.status_code == 200:
                tokens += answer["usage"]["completion_tokens"]
            verdicts[verdict(kind, i, r.status_code, answer, corpus)] += 1

        t0 = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n_req)))
    return tokens / (time.perf_counter() - t0), verdicts


def servers(args: argparse.Namespace, corpus: list[dict[str, Any]], folder: Path) -> None:
    from llama_side import llama_environment
    from llamaserver_build import DEFAULT_BUILD_DIR, ensure_llama_server
    from rsmem.engine.llm import default_model_path
    from server_vs_llamaserver import Server, free_port, random_130m_gguf

    binary = ensure_llama_server(DEFAULT_BUILD_DIR)
    levels = list(map(int, args.seqs.split(",")))
    slots = max(levels)
    print(
        "\n| model | request | concurrent | rsmem tok/s | llama-server tok/s | ratio, median | lowest round "
        "| rsmem valid | llama-server valid |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        source = default_model_path() if name == "embedded" else random_130m_gguf("mamba2")
        gguf = hermes_gguf(source, folder)
        p1, p2 = free_port(), free_port()
        llama = [str(binary), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(p1), "-np", str(slots)]
        llama += f"-c {slots * 1024} -t {args.threads} -tb {args.threads} --jinja --no-webui".split()
        mine = [str(Path(sys.executable).parent / "rsmem"), "serve", "-m", str(gguf), "--port", str(p2)]
        mine += ["-np", str(slots), "-t", str(args.threads), "--max-queue", "512"]
        both = {
            "rsmem": Server("rsmem", mine, p2, folder / "rsmem.log"),
            "llama-server": Server("llama", llama, p1, folder / "llama.log", env=llama_environment()),
        }
        try:
            for s in both.values():
                s.start()
            kinds = args.kinds.split(",")
            for kind in kinds:  # warm-up: compiled steps and schemas, each level's batch shapes
                for s in both.values():
                    for conc in levels:
                        asyncio.run(wave(s.url, kind, conc, conc, args.max_tokens, corpus))
            for kind in kinds:
                for conc in levels:
                    tps: dict[str, list[float]] = {k: [] for k in both}
                    seen: dict[str, Counter[str]] = {k: Counter() for k in both}
                    for r in range(args.rounds):
                        for k in list(both) if r % 2 == 0 else list(both)[::-1]:
                            rate, v = asyncio.run(
                                wave(both[k].url, kind, conc, max(conc, 8), args.max_tokens, corpus)
                            )
                            tps[k].append(rate)
                            seen[k] += v
                    ratios = [a / b for a, b in zip(tps["rsmem"], tps["llama-server"], strict=True)]
                    cells = [
                        f"{statistics.median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})" for v in tps.values()
                    ]
                    valid = [show(seen[k]) for k in both]
                    print(
                        f"| {name} | {kind} | {conc} | {cells[0]} | {cells[1]} "
                        f"| {statistics.median(ratios):.2f} | {min(ratios):.2f} | {valid[0]} | {valid[1]} |",
                        flush=True,
                    )
        finally:
            for s in both.values():
                s.stop()


def show(v: Counter[str]) -> str:
    total = sum(v.values())
    rest = ", ".join(f"{k} {n}" for k, n in sorted(v.items()) if k != "valid")
    return f"{v['valid']}/{total}" + (f" ({rest})" if rest else "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default="engine,servers")
    ap.add_argument("--models", default="embedded")
    ap.add_argument("--seqs", default="1,8,64")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--rows", default="constrained,no-forced,free", help="engine rows")
    ap.add_argument("--kinds", default="json_schema,grammar,tools", help="server requests")
    args = ap.parse_args()
    corpus = json.loads(CORPUS.read_text())
    if "engine" in args.parts:
        engine(args, corpus)
    if "servers" in args.parts:
        with tempfile.TemporaryDirectory() as tmp:
            servers(args, corpus, Path(tmp))


if __name__ == "__main__":
    main()
