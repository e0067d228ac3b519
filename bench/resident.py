"""Resident memory a model adds to a process: after loading its GGUF, and after generating 8 tokens.

Each measurement runs in a fresh process: ``import rsmem, torch``, then ``rsmem.load_model(path)``, then a
Context that decodes an 8-token prompt and 8 greedy tokens one at a time (the first-step kernels and the
states included). The process reads ``/proc/self/status`` at each stage; the table gives what loading and
generating added to ``VmRSS`` after the imports (the ``anon`` and ``file`` columns split it into anonymous
memory and mapped file pages, ``RssAnon`` and ``RssFile``; ``peak`` is ``VmHWM``, the highest RSS the
process reached, loading included), medians over ``--rounds`` processes with their range.

The models: random 130M Mamba and Mamba-2 built by transformers with ``bench/throughput.py``'s configs and
~146M LFM2 with ``bench/archs_hybrid.py``'s, converted by ``rsmem.convert`` to f32; Mamba's Q8_0 and Q4_K_M
by rsmem's own quantizer (``rsmem.loaders.quantize``). Files are kept in ``--cache`` between runs.

Run: .venv/bin/python bench/resident.py [--models mamba-f32,mamba2-f32,...] [--rounds 3]
[--env RSMEM_PACKED_TWINS=0] [--llama-server ~/.cache/rsmem-bench/llama-server-b11312/bin/llama-server]

With ``--llama-server``, llama.cpp's columns: what ``llama-server`` holds after loading the file and after an
8-token completion, less what it holds with the tiny Mamba fixture (its own runtime).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import urllib.request
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
        if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
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


def llama_server(binary: Path, path: Path, port: int) -> dict[str, dict[str, int]]:
    """llama.cpp's side: ``llama-server`` on ``path`` (one slot, 4,096 cells of f32 KV as rsmem's Context
    has, 2 threads), its stages (kB) after the model loaded and after an 8-token completion."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    args = [str(binary), "-m", str(path), "--port", str(port), "-c", "4096", "-np", "1", "-t", "2"]
    proc = subprocess.Popen(
        [*args, "-ctk", "f32", "-ctv", "f32"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"llama-server did not start on {path}")
            time.sleep(0.2)
        stages = {"load": status(proc.pid)}
        body = json.dumps({"prompt": "the quick brown fox", "n_predict": 8, "temperature": 0}).encode()
        request = urllib.request.Request(f"{url}/completion", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as r:
            r.read()
        stages["generate"] = status(proc.pid)
        return stages
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def status(pid: int) -> dict[str, int]:
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                fields[key] = int(value.split()[0])
    return fields


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
    parser.add_argument(
        "--llama-server", type=Path, help="a llama-server binary (b11312): llama.cpp's columns"
    )
    args = parser.parse_args()
    env = dict(item.split("=", 1) for item in args.env)
    baseline: list[dict[str, dict[str, int]]] = []
    if args.llama_server:  # the server with a tiny model: what llama.cpp holds without a model's weights
        tiny = Path(__file__).parent.parent / "tests/fixtures/llamacpp/mamba/model-q8_0.gguf"
        baseline = [llama_server(args.llama_server, tiny, 18931) for _ in range(args.rounds)]
    args.cache.mkdir(parents=True, exist_ok=True)
    raw: dict[str, list[dict[str, dict[str, int]]]] = {}
    head = "| model (file) | after import | load adds | anon | file | + 8 tokens adds | anon | file | peak "
    head += "| ratio |"
    print(head + (" llama.cpp load adds | + 8 tokens adds | peak | rsmem / llama.cpp |" if baseline else ""))
    print("|---" * (14 if baseline else 10) + "|")
    for name in args.models.split(","):
        path = build(name, args.cache)
        size = path.stat().st_size / 1e6
        runs = raw[name] = [measure(path, env) for _ in range(args.rounds)]

        def added(stage: str, key: str, runs=runs) -> list[float]:
            base = "VmRSS" if key == "VmHWM" else key  # the peak: the highest RSS, over the imports' RSS
            return [(r[stage][key] - r["import"][base]) * 1024 / 1e6 for r in runs]

        base = [r["import"]["VmRSS"] * 1024 / 1e6 for r in runs]
        gen = added("generate", "VmRSS")
        ratio = statistics.median(gen) / size
        line = (
            f"| {name} ({size:,.0f} MB) | {cell(base)} | {cell(added('load', 'VmRSS'))} | "
            f"{cell(added('load', 'RssAnon'))} | {cell(added('load', 'RssFile'))} | {cell(gen)} | "
            f"{cell(added('generate', 'RssAnon'))} | {cell(added('generate', 'RssFile'))} | "
            f"{cell(added('generate', 'VmHWM'))} | {ratio:.2f} |"
        )
        if baseline:
            theirs = [llama_server(args.llama_server, path, 18932) for _ in range(args.rounds)]
            raw[f"llama:{name}"] = theirs

            def llama(stage: str, key: str = "VmRSS", theirs=theirs) -> list[float]:
                return [
                    (t[stage][key] - b[stage][key]) * 1024 / 1e6
                    for t, b in zip(theirs, baseline, strict=True)
                ]

            versus = statistics.median(gen) / statistics.median(llama("generate"))
            line += (
                f" {cell(llama('load'))} | {cell(llama('generate'))} | {cell(llama('generate', 'VmHWM'))} | "
                f"{versus:.2f} |"
            )
        print(line, flush=True)
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
