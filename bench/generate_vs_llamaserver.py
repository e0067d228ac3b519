"""One long generation: ``rsmem generate`` against llama-server's own ``timings`` on the same GGUF.

    python bench/generate_vs_llamaserver.py [--rounds 5] [--tokens 1000] [--model FILE] [--threads 2]

llama-server (b11312, built by bench/llamaserver_build.py) runs once with one slot and ``--threads``
threads; each round, in alternating order, ``rsmem generate "ROMEO:" -n N --ignore-eos`` (a fresh
process, its printed generated tokens/s) and one ``/completion`` of the same prompt with ``n_predict`` N
and ``ignore_eos`` (its ``timings.predicted_per_second``, the generation alone), greedy and at
temperature 0.8 with the same chain (top-k 40, top-p 0.95, min-p 0.05, repetition penalty 1.1 over the
last 64 tokens, seed 1). The table gives medians with their range, the median of the per-round ratios
rsmem / llama-server and the lowest round's ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llamaserver_build import DEFAULT_BUILD_DIR, ensure_llama_server

SPEED = re.compile(r"([\d.]+) tok/s generated")
CHAIN = {"top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_penalty": 1.1, "repeat_last_n": 64, "seed": 1}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rsmem_speed(model: Path, temp: float, args: argparse.Namespace) -> float:
    cmd = [
        sys.executable,
        "-m",
        "rsmem.cli",
        "generate",
        "ROMEO:",
        "-n",
        str(args.tokens),
        "--temp",
        str(temp),
    ]
    cmd += ["--seed", "1", "--ignore-eos", "-t", str(args.threads), "-m", str(model)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    found = SPEED.search(out.stderr)
    if found is None:
        raise SystemExit(f"no speed line from rsmem: {out.stderr[-500:]}")
    return float(found.group(1))


def llama_speed(port: int, temp: float, args: argparse.Namespace) -> float:
    body = {"prompt": "ROMEO:", "n_predict": args.tokens, "ignore_eos": True, "temperature": temp, **CHAIN}
    body["cache_prompt"] = False
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=600) as resp:
        return float(json.load(resp)["timings"]["predicted_per_second"])


def wait_ready(port: int, proc: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit("llama-server exited")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.1)
    raise SystemExit("llama-server did not start")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--model", type=Path, default=None, help="a GGUF (default: the embedded model)")
    args = ap.parse_args()
    from rsmem.engine.llm import default_model_path

    model = args.model or default_model_path()
    server = ensure_llama_server(DEFAULT_BUILD_DIR)
    port = free_port()
    cmd = [str(server), "-m", str(model), "--host", "127.0.0.1", "--port", str(port), "-np", "1"]
    cmd += ["-c", str(args.tokens + 64), "-t", str(args.threads), "-tb", str(args.threads)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_ready(port, proc)
        print("| sampling | rsmem tok/s | llama-server tok/s | ratio, median | lowest round |")
        print("|---|---|---|---|---|")
        for label, temp in (("greedy", 0.0), ("temperature 0.8", 0.8)):
            mine, theirs, ratios = [], [], []
            llama_speed(port, temp, args)  # warm-up
            for k in range(args.rounds):
                if k % 2:
                    b, a = llama_speed(port, temp, args), rsmem_speed(model, temp, args)
                else:
                    a, b = rsmem_speed(model, temp, args), llama_speed(port, temp, args)
                mine.append(a)
                theirs.append(b)
                ratios.append(a / b)
            cells = [f"{statistics.median(v):,.0f} ({min(v):,.0f}-{max(v):,.0f})" for v in (mine, theirs)]
            print(
                f"| {label} | {cells[0]} | {cells[1]} | {statistics.median(ratios):.2f} | {min(ratios):.2f} |"
            )
    finally:
        proc.terminate()
        proc.wait(timeout=10)


if __name__ == "__main__":
    main()
