"""Bounded load test of ``rsmem serve`` on loopback: concurrent streaming clients, some cancelling.

Starts the server as a subprocess on a free 127.0.0.1 port, runs a fixed number of streaming
completion requests from ``--clients`` concurrent clients, and reports requests per second, time to
first token (p50/p99), and generated tokens per second. Then it checks that every non-cancelled
response is complete (ends with a finish reason and [DONE]), that the cancelled ones freed their
slots, and that the memory is empty at the end (the server runs with --no-prompt-cache so a finished
request keeps no state).

Run: .venv/bin/python bench/server_load.py [--clients 64] [--requests 128] [--parallel 16]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass

import httpx

PROMPTS = [
    "ROMEO:",
    "JULIET:\nO Romeo, Romeo,",
    "First Citizen:\nBefore we proceed any further,",
    "KING HENRY:",
    "To be, or not to be,",
    "HAMLET:\nWhat a piece of work",
]


@dataclass
class Result:
    ok: bool
    cancelled: bool
    ttft: float | None
    tokens: int
    seconds: float
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def one_request(client: httpx.AsyncClient, url: str, k: int, max_tokens: int, cancel: bool) -> Result:
    body = {
        "model": "m",
        "prompt": PROMPTS[k % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": k,
        "stream": True,
    }
    t0 = time.perf_counter()
    ttft, chunks, finish, done = None, 0, None, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                return Result(False, cancel, None, 0, time.perf_counter() - t0, f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                choice = json.loads(data)["choices"][0]
                if choice["text"] and ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
                finish = choice["finish_reason"] or finish
                if cancel and chunks >= 3:
                    return Result(True, True, ttft, chunks, time.perf_counter() - t0)
    except httpx.HTTPError as exc:
        return Result(False, cancel, ttft, chunks, time.perf_counter() - t0, repr(exc))
    ok = done and finish in ("length", "stop")
    return Result(ok, False, ttft, chunks, time.perf_counter() - t0, "" if ok else "incomplete stream")


async def run_load(
    url: str, n_clients: int, n_requests: int, max_tokens: int, cancel_every: int
) -> list[Result]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(n_requests):
        queue.put_nowait(k)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=n_clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                k = queue.get_nowait()
                cancel = cancel_every > 0 and k % cancel_every == cancel_every - 1
                results.append(await one_request(client, url, k, max_tokens, cancel))

        await asyncio.gather(*(worker() for _ in range(n_clients)))
    return results


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=16, help="server slots")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cancel-every", type=int, default=8, help="every Nth request disconnects early")
    parser.add_argument("--model", help="model for the server (default: the embedded model)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "rsmem.cli",
        "serve",
        "--port",
        str(port),
        "--parallel",
        str(args.parallel),
        "--max-queue",
        str(args.requests),
        "--no-prompt-cache",
        "--threads",
        "2",
    ]
    if args.model:
        cmd += ["-m", args.model]
    server = subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                print("server did not start:", server.stderr.read() if server.stderr else "", file=sys.stderr)
                return 1
            time.sleep(0.2)

        t0 = time.perf_counter()
        results = asyncio.run(run_load(url, args.clients, args.requests, args.max_tokens, args.cancel_every))
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        m = metrics(url)
    finally:
        server.terminate()
        server.wait(timeout=30)

    complete = [r for r in results if r.ok and not r.cancelled]
    cancelled = [r for r in results if r.cancelled]
    failed = [r for r in results if not r.ok]
    ttfts = sorted(r.ttft for r in results if r.ttft is not None)
    tokens = m["rsmem_generation_tokens_total"]  # generated by the server, cancelled requests included
    print(
        f"server load: {args.requests} streaming requests, {args.clients} concurrent clients, "
        f"{args.parallel} slots, max_tokens {args.max_tokens}, every {args.cancel_every}th cancels"
    )
    print(
        f"{'requests/s':>12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tokens/s':>10} {'complete':>9} "
        f"{'cancelled':>10} {'failed':>7}"
    )
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan")
    print(
        f"{len(results) / wall:>12.2f} {statistics.median(ttfts) * 1e3:>12.0f} {p99 * 1e3:>12.0f} "
        f"{tokens / wall:>10.1f} {len(complete):>9} {len(cancelled):>10} {len(failed):>7}"
    )
    print(
        f"server metrics after the run: running {m['rsmem_requests_running']:.0f}, "
        f"active cells {m['rsmem_memory_cells_active']:.0f}, used cells {m['rsmem_memory_cells_used']:.0f}, "
        f"queue {m['rsmem_queue_length']:.0f}, finished {m['rsmem_requests_finished_total']:.0f}"
    )
    checks = {
        "every non-cancelled response complete": not failed,
        "cancelled clients freed their slots": m["rsmem_requests_running"] == 0
        and m["rsmem_memory_cells_active"] == 0,
        "memory empty at the end": m["rsmem_memory_cells_used"] == 0,
        "server finished every request": m["rsmem_requests_finished_total"] == args.requests,
    }
    for name, passed in checks.items():
        print(f"  [{'ok' if passed else 'FAIL'}] {name}")
    for r in failed[:5]:
        print(f"  failure: {r.error}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
