"""Bounded load test of ``rsmem serve`` on loopback: concurrent streaming clients, some cancelling, and
optionally a share of bad requests.

Starts the server as a subprocess on a free 127.0.0.1 port, runs a fixed number of requests from
``--clients`` concurrent clients, and reports requests per second, time to first token (p50/p99) of
the good streaming requests, generated tokens per second, and **lost**: good requests that did not
complete (must be 0). Every ``--cancel-every``-th good request disconnects after 3 chunks.

``--fault-share S`` makes that share of the requests bad, cycling through: an invalid parameter
(``repeat_penalty`` 1e-40: 400), an unknown model (404), a malformed JSON body (400), a body above
``--max-body-bytes`` (413), and a non-streaming client that disconnects 50-300 ms after sending (its
request is queued, prefilling or decoding then). Each bad request must get exactly its expected answer
(the disconnecting ones none); no answer may be a 5xx.

At the end it checks that nothing runs or waits, that the memory is empty (the server runs with
``--no-prompt-cache``, so a finished request keeps no state), and that ``/health`` is ``ok``.

Run: .venv/bin/python bench/server_load.py [--clients 64] [--requests 128] [--parallel 16]
     [--fault-share 0.25]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
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
FAULTS = ["invalid", "unknown_model", "bad_json", "too_large", "disconnect"]
EXPECTED = {"invalid": 400, "unknown_model": 404, "bad_json": 400, "too_large": 413, "disconnect": None}
MAX_BODY = 65536


@dataclass
class Result:
    kind: str  # "good", "cancel", or a fault kind
    ok: bool  # a good request completed / a bad one got exactly its expected answer
    ttft: float | None = None
    status: int | None = None
    error: str = ""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def good_body(k: int, max_tokens: int, stream: bool = True) -> dict:
    return {
        "prompt": PROMPTS[k % len(PROMPTS)],
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": k,
        "stream": stream,
    }


async def streaming(client: httpx.AsyncClient, url: str, k: int, max_tokens: int, cancel: bool) -> Result:
    kind = "cancel" if cancel else "good"
    t0 = time.perf_counter()
    ttft, chunks, finish, done = None, 0, None, False
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=good_body(k, max_tokens)) as r:
            if r.status_code != 200:
                return Result(kind, False, None, r.status_code, f"HTTP {r.status_code}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                event = json.loads(data)
                if "error" in event:
                    return Result(kind, False, ttft, 200, f"error event: {event['error']['message']}")
                choice = event["choices"][0]
                if choice["text"] and ttft is None:
                    ttft = time.perf_counter() - t0
                chunks += 1
                finish = choice["finish_reason"] or finish
                if cancel and chunks >= 3:
                    return Result(kind, True, ttft, 200)
    except httpx.HTTPError as exc:
        return Result(kind, False, ttft, None, repr(exc))
    ok = done and finish in ("length", "stop")
    return Result(kind, ok, ttft, 200, "" if ok else "incomplete stream")


async def bad(client: httpx.AsyncClient, url: str, k: int, kind: str, max_tokens: int) -> Result:
    endpoint = f"{url}/v1/completions"
    body = good_body(k, max_tokens, stream=False)
    try:
        if kind == "invalid":
            r = await client.post(endpoint, json=body | {"repeat_penalty": 1e-40})
        elif kind == "unknown_model":
            r = await client.post(endpoint, json=body | {"model": "no-such-model"})
        elif kind == "bad_json":
            r = await client.post(endpoint, content=b'{"prompt": "ROMEO:", ', headers=_json)
        elif kind == "too_large":
            r = await client.post(endpoint, json=body | {"prompt": "x" * (MAX_BODY + 1)})
        else:  # disconnect: leave while the request is queued, prefilling or decoding
            wait = random.Random(k).uniform(0.05, 0.3)
            try:
                r = await asyncio.wait_for(
                    client.post(endpoint, json=body | {"max_tokens": 4 * max_tokens}), wait
                )
            except TimeoutError:
                return Result(kind, True, error="left")
            return Result(kind, r.status_code < 500, status=r.status_code)  # it finished in time
    except httpx.HTTPError as exc:
        return Result(kind, False, error=repr(exc))
    expected = EXPECTED[kind]
    shaped = r.status_code >= 400 and set(r.json()) == {"error"}
    ok = r.status_code == expected and shaped
    return Result(
        kind, ok, status=r.status_code, error="" if ok else f"{kind}: HTTP {r.status_code} {r.text[:120]}"
    )


_json = {"content-type": "application/json"}


def plan(n_requests: int, fault_share: float, cancel_every: int) -> list[str]:
    """The kind of each request: faults spread evenly, cycling through FAULTS."""
    kinds, n_faults, good = [], 0, 0
    for k in range(n_requests):
        if fault_share > 0 and n_faults < round((k + 1) * fault_share):
            kinds.append(FAULTS[n_faults % len(FAULTS)])
            n_faults += 1
        else:
            good += 1
            kinds.append("cancel" if cancel_every > 0 and good % cancel_every == 0 else "good")
    return kinds


async def run_load(url: str, n_clients: int, kinds: list[str], max_tokens: int) -> list[Result]:
    queue: asyncio.Queue[int] = asyncio.Queue()
    for k in range(len(kinds)):
        queue.put_nowait(k)
    results: list[Result] = []
    limits = httpx.Limits(max_connections=n_clients + 4)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:

        async def worker() -> None:
            while not queue.empty():
                k = queue.get_nowait()
                kind = kinds[k]
                if kind in ("good", "cancel"):
                    results.append(await streaming(client, url, k, max_tokens, kind == "cancel"))
                else:
                    results.append(await bad(client, url, k, kind, max_tokens))

        await asyncio.gather(*(worker() for _ in range(n_clients)))
    return results


def scrape(url: str) -> tuple[dict[str, float], int]:
    """Unlabelled metrics, and the number of 5xx answers the server counted."""
    out, errors = {}, 0
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith("rsmem_requests_total{") and 'code="5' in line:
            errors += int(float(line.rsplit(" ", 1)[1]))
        elif line and not line.startswith("#") and "{" not in line:
            name, value = line.split()
            out[name] = float(value)
    return out, errors


def start_server(args: argparse.Namespace, port: int) -> subprocess.Popen[str]:
    cmd = [sys.executable, "-m", "rsmem.cli", "serve", "--port", str(port), "--parallel", str(args.parallel)]
    cmd += ["--max-queue", str(args.requests), "--max-body-bytes", str(MAX_BODY), "--no-prompt-cache"]
    cmd += ["--threads", "2"] + (["-m", args.model] if args.model else [])
    return subprocess.Popen(
        cmd, stderr=subprocess.PIPE, text=True, env=os.environ | {"PYTHONUNBUFFERED": "1"}
    )


def wait_until_up(url: str, server: subprocess.Popen[str]) -> bool:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and server.poll() is None:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--parallel", type=int, default=16, help="server slots")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument(
        "--cancel-every", type=int, default=8, help="every Nth good request disconnects early"
    )
    parser.add_argument("--fault-share", type=float, default=0.0, help="share of bad requests (0 to 1)")
    parser.add_argument("--model", help="model for the server (default: the embedded model)")
    args = parser.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = start_server(args, port)
    try:
        if not wait_until_up(url, server):
            print("server did not start:", server.stderr.read() if server.stderr else "", file=sys.stderr)
            return 1
        kinds = plan(args.requests, args.fault_share, args.cancel_every)
        t0 = time.perf_counter()
        results = asyncio.run(run_load(url, args.clients, kinds, args.max_tokens))
        wall = time.perf_counter() - t0
        time.sleep(0.5)
        m, server_errors = scrape(url)
        health = httpx.get(f"{url}/health").json()
    finally:
        server.terminate()
        server.wait(timeout=30)
    return report(args, results, wall, m, server_errors, health)


def report(args, results: list[Result], wall: float, m: dict, server_errors: int, health: dict) -> int:  # type: ignore[no-untyped-def]
    good = [r for r in results if r.kind == "good"]
    lost = [r for r in good if not r.ok]
    cancelled = [r for r in results if r.kind == "cancel"]
    faults = [r for r in results if r.kind in FAULTS]
    wrong = [r for r in faults + cancelled if not r.ok]
    ttfts = sorted(r.ttft for r in good + cancelled if r.ttft is not None)
    p99 = ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))] if ttfts else float("nan")
    p50 = statistics.median(ttfts) if ttfts else float("nan")
    mix = f"{len(good)} good, {len(cancelled)} cancelling, {len(faults)} bad"
    print(
        f"server load: {args.requests} requests ({mix}), {args.clients} concurrent clients, "
        f"{args.parallel} slots, max_tokens {args.max_tokens}"
    )
    print(
        f"{'requests/s':>12} {'TTFT p50 ms':>12} {'TTFT p99 ms':>12} {'tokens/s':>10} {'complete':>9} "
        f"{'cancelled':>10} {'bad':>5} {'lost':>5}"
    )
    print(
        f"{len(results) / wall:>12.2f} {p50 * 1e3:>12.0f} {p99 * 1e3:>12.0f} "
        f"{m['rsmem_generation_tokens_total'] / wall:>10.1f} {len(good) - len(lost):>9} {len(cancelled):>10} "
        f"{len(faults):>5} {len(lost):>5}"
    )
    by_kind = {kind: sum(1 for r in faults if r.kind == kind) for kind in FAULTS}
    if faults:
        left = sum(1 for r in faults if r.error == "left")
        print(
            "bad requests: "
            + ", ".join(f"{k} {n}" for k, n in by_kind.items() if n)
            + f" ({left} left early)"
        )
    checks = {
        "lost = 0 (every good request complete)": not lost,
        "every bad or cancelling request got its expected answer": not wrong,
        "no 5xx answer": server_errors == 0,
        "nothing running or waiting": m["rsmem_requests_running"] == 0 and m["rsmem_queue_length"] == 0,
        "memory empty at the end": m["rsmem_memory_cells_used"] == 0 and m["rsmem_memory_cells_active"] == 0,
        "health ok": health.get("status") == "ok",
    }
    for name, passed in checks.items():
        print(f"  [{'ok' if passed else 'FAIL'}] {name}")
    for r in (lost + wrong)[:5]:
        print(f"  failure: {r.kind}: {r.error}")
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
