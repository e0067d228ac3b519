"""Resident memory a model adds to a process: after loading its GGUF, and after generating 8 tokens.

Each measurement runs in a fresh process: ``import rsmem, torch``, then ``rsmem.load_model(path)``, then a
Context that decodes an 8-token prompt and 8 greedy tokens one at a time (the first-step kernels and the
states included). The process reads ``/proc/self/status`` at each stage; the table gives what loading and
generating added to ``VmRSS`` after the imports (the ``anon`` and ``file`` columns split it into anonymous
memory and mapped file pages, ``RssAnon`` and ``RssFile``), medians over ``--rounds`` processes with their
range.

The models: random 130M Mamba and Mamba-2 built by transformers with ``bench/throughput.py``'s configs and
~146M LFM2 with ``bench/archs_hybrid.py``'s, converted by ``rsmem.convert`` to f32; Mamba's Q8_0 and Q4_K_M
by rsmem's own quantizer (``rsmem.loaders.quantize``). Files are kept in ``--cache`` between runs.

Run: .venv/bin/python bench/resident.py [--models mamba-f32,mamba2-f32,...] [--rounds 3]
[--env RSMEM_PACKED_TWINS=0]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

# isort: off
import rsmem  # first: it sets OpenMP's wait policy before torch loads (rsmem.threads)
import torch

# isort: on

sys.path.insert(0, str(Path(__file__).parent))

MODELS = ("mamba-f32", "mamba2-f32", "mamba-q8_0", "mamba-q4_k_m", "lfm2-f32")

# One measurement: the stages' /proc/self/status fields (kB) as one JSON line on stdout.
CHILD = r"""
import json, sys
def status():
    fields = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0])
    return fields
import rsmem, torch
stages = {"import": status()}
model = rsmem.load_model(sys.argv[1])
stages["load"] = status()
ctx = rsmem.Context(model)
prompt = [(7 * i) % 1000 + 1 for i in range(8)]
ctx.decode(rsmem.Batch(prompt, logits=[False] * 7 + [True]))
pos = len(prompt)
for _ in range(8):
    token = int(ctx.get_logits(-1).argmax())
    ctx.decode(rsmem.Batch([token], pos=[pos], seq_ids=[[0]], logits=[True]))
    pos += 1
stages["generate"] = status()
print(json.dumps(stages))
"""


def build(name: str, cache: Path) -> Path:
    """The GGUF file of ``name`` (``arch-weights``) in ``cache``, written on first use."""
    path = cache / f"{name}.gguf"
    if path.exists():
        return path
    arch, weights = name.split("-", 1)
    if weights != "f32":
        from rsmem.loaders.quantize import quantize_gguf

        return quantize_gguf(build(f"{arch}-f32", cache), path, weights)
    folder = cache / f"{arch}-hf"
    torch.manual_seed(0)
    if arch == "lfm2":
        from archs_hybrid import hf_model
        from archs_hybrid import write_byte_tokenizer as hybrid_tokenizer

        model = hf_model("lfm2").eval()
        model.save_pretrained(folder)
        hybrid_tokenizer(folder, model.config.vocab_size)
    else:
        from transformers import Mamba2ForCausalLM, MambaForCausalLM

        from throughput import hf_config, write_byte_tokenizer

        cls = MambaForCausalLM if arch == "mamba" else Mamba2ForCausalLM
        model = cls(hf_config(arch)).eval()
        model.save_pretrained(folder)
        write_byte_tokenizer(folder, model.config.vocab_size)
    del model
    return Path(rsmem.convert(folder, path, "f32"))


def measure(path: Path, env: dict[str, str]) -> dict[str, dict[str, int]]:
    """One fresh process's stages (kB), ``env`` added to its environment."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD, str(path)],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, **env},
    )
    stages: dict[str, dict[str, int]] = json.loads(out.stdout.strip().splitlines()[-1])
    return stages


def cell(values: list[float]) -> str:
    """The median in MB, with the range when the rounds differ by at least 1 MB."""
    mid = statistics.median(values)
    lo, hi = min(values), max(values)
    return f"{mid:,.0f}" if hi - lo < 1 else f"{mid:,.0f} ({lo:,.0f}-{hi:,.0f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated: " + ", ".join(MODELS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cache", type=Path, default=Path("/tmp/rsmem-resident"))
    parser.add_argument("--json", type=Path, help="also write the raw measurements here")
    parser.add_argument(
        "--env", action="append", default=[], help="KEY=VALUE for the measured processes (repeatable)"
    )
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    args.cache.mkdir(parents=True, exist_ok=True)
    raw: dict[str, list[dict[str, dict[str, int]]]] = {}
    print("| model (file) | after import | load adds | anon | file | + 8 tokens adds | anon | file | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name in args.models.split(","):
        path = build(name, args.cache)
        size = path.stat().st_size / 1e6
        runs = raw[name] = [measure(path, env) for _ in range(args.rounds)]

        def added(stage: str, key: str, runs=runs) -> list[float]:
            return [(r[stage][key] - r["import"][key]) * 1024 / 1e6 for r in runs]

        base = [r["import"]["VmRSS"] * 1024 / 1e6 for r in runs]
        gen = added("generate", "VmRSS")
        ratio = statistics.median(gen) / size
        print(
            f"| {name} ({size:,.0f} MB) | {cell(base)} | {cell(added('load', 'VmRSS'))} | "
            f"{cell(added('load', 'RssAnon'))} | {cell(added('load', 'RssFile'))} | {cell(gen)} | "
            f"{cell(added('generate', 'RssAnon'))} | {cell(added('generate', 'RssFile'))} | {ratio:.2f} |",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
