"""``rsmem serve`` against llama.cpp's ``llama-server`` (b11312) on the same GGUF, slots and threads.

Both servers run as subprocesses on 127.0.0.1 with 4 slots, ``--threads`` threads (default 2) and their
prompt caches on (llama-server ``-np 4 -c 4*CTX -t N -tb N``, cache_prompt by default; ``rsmem serve -np 4
-t N``, prefix cache on by default).
llama-server gets a chat template file that renders rsmem's plain template, so both see the same prompts;
every request asks for ``stop: ["\\nUser:"]``, temperature 0 and a fixed seed. Workloads:

- ``a``: C conversations x T turns at once (multi-turn chat, ~400-word shared system prompt, max_tokens 32,
  streamed ``/v1/chat/completions``; each turn appends the answer and a new user message); TTFT of turns >= 2;
- ``b``: 64 concurrent streamed ``/v1/completions``, prompts of 8..1024 tokens (log-spaced, shuffled);
- ``c``: 3 short (3-token) streamed requests on an idle server, then 0.2 s after a ~4000-token prompt.

Rounds alternate the order of the servers (a fresh server each time). Each round's figures are printed,
with the server process's CPU seconds for the workload (user + system, from /proc: on a machine others
load, it says more than wall time); the summary gives each server's median, the median of the per-round
ratios rsmem / llama-server and the worst round for rsmem (the highest ratio of a time, the lowest of a
rate).

    python bench/server_vs_llamaserver.py [--model embedded|130m|both] [--rounds 3] [--workloads a,b,c]
                                          [--quick]

llama-server is built by bench/llamaserver_build.py (reused from ~/.cache/rsmem-bench when built).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
import itertools

from llama_side import llama_environment
from llamaserver_build import DEFAULT_BUILD_DIR, ensure_llama_server

CACHE = Path.home() / ".cache" / "rsmem-bench"
SLOTS, CTX = 4, 8192
STOP = ["\nUser:"]
PASSAGE = (
    "Now is the winter of our discontent made glorious summer by this sun of York; and all the clouds that "
    "lour'd upon our house in the deep bosom of the ocean buried. Friends, Romans, countrymen, lend me your "
    "ears; I come to bury Caesar, not to praise him. The evil that men do lives after them; the good is oft "
    "interred with their bones. To be, or not to be, that is the question: whether 'tis nobler in the mind "
    "to suffer the slings and arrows of outrageous fortune, or to take arms against a sea of troubles. "
    "But soft, what light through yonder window breaks? It is the east, and Juliet is the sun. "
)
QUESTIONS = ["Who art thou?", "Whence comest thou?", "What news?", "Why weep you?", "Where is the king?"]
# rsmem's plain chat template (server/chat.py), for llama-server's --chat-template-file
PLAIN_TEMPLATE = (
    "{%- for m in messages -%}{%- if m['role'] == 'system' -%}{{- m['content'] + '\\n\\n' -}}"
    "{%- elif m['role'] == 'assistant' -%}{{- 'Assistant: ' + m['content'] + '\\n' -}}"
    "{%- else -%}{{- 'User: ' + m['content'] + '\\n' -}}{%- endif -%}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- 'Assistant:' -}}{%- endif -%}"
)


# ------------------------------------------------------------------ models


def embedded_gguf() -> Path:
    from rsmem.engine import default_model_path

    return default_model_path()


def random_130m_gguf(arch: str) -> Path:
    """A 130M-class random model (bench/throughput.py's configs) with the embedded model's tokenizer, padded
    to the 130M vocabulary (the padding rows zeroed); written once to ~/.cache/rsmem-bench/models."""
    out = CACHE / "models" / f"{arch}-130m-random-v2-f32.gguf"
    if out.is_file():
        return out
    import gguf
    import torch
    from transformers import Mamba2ForCausalLM, MambaForCausalLM

    import rsmem
    from rsmem.loaders.tokenizer import tokenizer_data_from_gguf
    from throughput import hf_config

    data = tokenizer_data_from_gguf(gguf.GGUFReader(embedded_gguf()))
    assert data is not None
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        torch.manual_seed(0)
        config = hf_config(arch)
        config.bos_token_id = config.eos_token_id = config.pad_token_id = data.eos_id
        model = (MambaForCausalLM if arch == "mamba" else Mamba2ForCausalLM)(config)
        with torch.no_grad():  # padding tokens get logit 0, below the best real token's: text comes out
            model.get_input_embeddings().weight[len(data.tokens) :] = 0
            model.get_output_embeddings().weight[len(data.tokens) :] = 0
        model.save_pretrained(folder)
        special = [i for i, t in enumerate(data.token_types) if t == gguf.TokenType.CONTROL]
        vocab = {t: i for i, t in enumerate(data.tokens) if i not in special}
        added = [{"id": i, "content": data.tokens[i], "special": True} for i in special]
        added.append({"id": config.vocab_size - 1, "content": "<|unused_last|>", "special": False})
        spec = {"version": "1.0", "added_tokens": added, "model": {"type": "BPE", "vocab": vocab}}
        spec["model"]["merges"] = data.merges
        (folder / "tokenizer.json").write_text(json.dumps(spec))
        rsmem.convert(folder, out, "f32")
    return out


# ------------------------------------------------------------------ servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess, ready once ``/health`` answers 200; stopped with SIGINT, then SIGKILL."""

    def __init__(
        self, name: str, cmd: list[str], port: int, log: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name, self.cmd, self.url, self.log = name, cmd, f"http://127.0.0.1:{port}", log
        self.env = env
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 300) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                self.cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=self.env
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); see {self.log}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"{self.name} not ready after {timeout} s; see {self.log}")

    def cpu_seconds(self) -> float:
        """The server process's CPU time so far (user + system, all its threads), from /proc."""
        assert self.proc is not None
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rpartition(")")[2].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def make_server(name: str, gguf_path: Path, args: argparse.Namespace, tmp: Path) -> Server:
    port = free_port()
    if name == "llama":
        template = tmp / "plain.jinja"
        template.write_text(PLAIN_TEMPLATE)
        cmd = [str(args.llama_server), "-m", str(gguf_path), "--host", "127.0.0.1", "--port", str(port)]
        cmd += ["-np", str(SLOTS), "-c", str(SLOTS * CTX), "-t", str(args.threads), "-tb", str(args.threads)]
        cmd += ["--chat-template-file", str(template), "--no-webui"]
        return Server(name, cmd, port, tmp / f"{name}.log", env=llama_environment())
    else:
        cmd = [str(Path(sys.executable).parent / "rsmem"), "serve", "-m", str(gguf_path), "--port", str(port)]
        cmd += [
            "-np",
            str(SLOTS),
            "-t",
            str(args.threads),
            "--max-prompt-tokens",
            str(CTX),
            "--max-queue",
            "256",
        ]
    return Server(name, cmd, port, tmp / f"{name}.log")


# ------------------------------------------------------------------ requests


@dataclass
class Result:
    ttft: float
    gaps: list[float]  # between successive chunks that carried text (bursts of chunks give ~0 gaps)
    tokens: int
    text: str
    prompt_tokens: int


async def stream(client: httpx.AsyncClient, url: str, path: str, body: dict) -> Result:
    body = body | {"stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "seed": 1}
    body.setdefault("stop", STOP)
    t0 = time.perf_counter()
    stamps: list[float] = []
    text, usage = "", {}
    async with client.stream("POST", f"{url}{path}", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"])
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text += piece
    end = time.perf_counter()
    ttft = (stamps[0] if stamps else end) - t0
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return Result(
        ttft, gaps, usage.get("completion_tokens", len(stamps)), text, usage.get("prompt_tokens", 0)
    )


def client_for(n: int) -> httpx.AsyncClient:
    """A client of ``n`` connections and no keep-alive: llama-server closes idle connections after 5 s
    and a pooled one reused at that moment fails with RemoteProtocolError (seen under load)."""
    return httpx.AsyncClient(
        timeout=600, limits=httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    )


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    k = (len(s) - 1) * q / 100
    lo = int(k)
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (k - lo)


def latency_figures(results: list[Result], ttfts: list[float], wall: float) -> dict[str, float]:
    gaps = [g for r in results for g in r.gaps]
    tpot = [sum(r.gaps) / (r.tokens - 1) for r in results if r.tokens > 1 and r.gaps]
    return {
        "TTFT p50 ms": 1e3 * pct(ttfts, 50),
        "TTFT p90 ms": 1e3 * pct(ttfts, 90),
        "TTFT p99 ms": 1e3 * pct(ttfts, 99),
        "ITL p50 ms": 1e3 * pct(gaps, 50),
        "ITL p99 ms": 1e3 * pct(gaps, 99),
        "TPOT p50 ms": 1e3 * pct(tpot, 50),
        "gen tok/s": sum(r.tokens for r in results) / wall,
        "wall s": wall,
        "prompt tok": float(sum(r.prompt_tokens for r in results)),
    }


class Texts:
    """Prompts of a given token length: slices of a long passage, measured with the model's tokenizer."""

    def __init__(self, gguf_path: Path) -> None:
        import gguf

        from rsmem.loaders.tokenizer import build_tokenizer, tokenizer_data_from_gguf

        data = tokenizer_data_from_gguf(gguf.GGUFReader(gguf_path))
        assert data is not None
        self.tok = build_tokenizer(data)
        self.ids = self.tok.encode(PASSAGE * 400).ids

    def of(self, n: int, offset: int = 0) -> str:
        offset %= len(self.ids) - n
        return self.tok.decode(self.ids[offset : offset + n])

    def words(self, n: int) -> str:
        words = PASSAGE.split()
        return " ".join(words[i % len(words)] for i in range(n))


async def workload_a(url: str, texts: Texts, args: argparse.Namespace) -> dict[str, float]:
    system = texts.words(args.system_words)
    results: list[Result] = []
    later: list[float] = []

    async def conversation(client: httpx.AsyncClient, k: int) -> None:
        messages = [{"role": "system", "content": system}]
        for turn in range(args.turns):
            messages.append(
                {"role": "user", "content": f"{QUESTIONS[(k + turn) % len(QUESTIONS)]} ({k}.{turn})"}
            )
            r = await stream(client, url, "/v1/chat/completions", {"messages": messages, "max_tokens": 32})
            results.append(r)
            if turn >= 1:
                later.append(r.ttft)
            messages.append({"role": "assistant", "content": r.text})

    t0 = time.perf_counter()
    async with client_for(4) as client:
        await asyncio.gather(*(conversation(client, k) for k in range(args.conversations)))
    return latency_figures(results, later, time.perf_counter() - t0)


async def workload_b(url: str, texts: Texts, args: argparse.Namespace) -> dict[str, float]:
    n = args.requests
    lengths = [round(8 * (args.max_len / 8) ** (i / max(n - 1, 1))) for i in range(n)]
    random.Random(7).shuffle(lengths)
    prompts = [texts.of(length, 97 * i) for i, length in enumerate(lengths)]
    t0 = time.perf_counter()
    async with client_for(n) as client:
        body = {"max_tokens": 32}
        jobs = (stream(client, url, "/v1/completions", body | {"prompt": p}) for p in prompts)
        results = list(await asyncio.gather(*jobs))
    return latency_figures(results, [r.ttft for r in results], time.perf_counter() - t0)


async def workload_c(url: str, texts: Texts, args: argparse.Namespace) -> dict[str, float]:
    idle: list[float] = []
    busy: list[float] = []
    long_ttft: list[float] = []
    async with client_for(4) as client:

        def shorts(rep: int) -> list:
            bodies = [{"prompt": texts.of(3, 1000 + 31 * (rep * 3 + j)), "max_tokens": 8} for j in range(3)]
            return [stream(client, url, "/v1/completions", b) for b in bodies]

        for rep in range(args.reps):
            idle += [r.ttft for r in await asyncio.gather(*shorts(rep))]
        for rep in range(args.reps):
            body = {"prompt": texts.of(args.long_len, 5000 + 997 * rep), "max_tokens": 8}
            long_job = asyncio.ensure_future(stream(client, url, "/v1/completions", body))
            await asyncio.sleep(0.2)
            busy += [r.ttft for r in await asyncio.gather(*shorts(rep + args.reps))]
            long_ttft.append((await long_job).ttft)
    return {
        "short TTFT idle p50 ms": 1e3 * pct(idle, 50),
        "short TTFT busy p50 ms": 1e3 * pct(busy, 50),
        "short TTFT busy max ms": 1e3 * max(busy),
        "long TTFT p50 ms": 1e3 * pct(long_ttft, 50),
    }


WORKLOADS = {"a": workload_a, "b": workload_b, "c": workload_c}


async def warm_up(url: str) -> None:
    async with client_for(4) as client:
        await stream(client, url, "/v1/completions", {"prompt": "ROMEO:", "max_tokens": 4})


# ------------------------------------------------------------------ report

HIGHER_IS_BETTER = ("gen tok/s",)


def summarize(name: str, rounds: list[dict[str, dict[str, float]]]) -> None:
    """rounds: per round, server -> figures of one workload; a round counts when both servers finished."""
    done = [r for r in rounds if "llama" in r and "rsmem" in r]
    print(f"\n{name}: median of {len(done)} rounds ({len(rounds) - len(done)} lost to a server failure)")
    if not done:
        return
    llama, rs = [r["llama"] for r in done], [r["rsmem"] for r in done]
    print("| metric | llama-server | rsmem | rsmem/llama (median) | worst round for rsmem |")
    print("|---|---|---|---|---|")
    for key in rs[0]:
        ratios = [r[key] / b[key] for r, b in zip(rs, llama, strict=True) if b[key] > 0.1]
        lm, rm = statistics.median(x[key] for x in llama), statistics.median(x[key] for x in rs)
        if ratios:
            worst = min(ratios) if key in HIGHER_IS_BETTER else max(ratios)
            shown = f"{statistics.median(ratios):.2f} | {worst:.2f}"
        else:
            shown = "n/a | n/a"
        print(f"| {key} | {lm:.1f} | {rm:.1f} | {shown} |")


Results = dict[str, list[dict[str, dict[str, float]]]]  # workload -> per round: server -> figures


def run_server(
    name: str,
    label: str,
    rnd: int,
    gguf_path: Path,
    texts: Texts,
    args: argparse.Namespace,
    tmp: Path,
    results: Results,
) -> None:
    """One server's round: start it, run the workloads, stop it. A server that fails (it crashed, or a
    request failed) loses the rest of its round; its log is kept in ~/.cache/rsmem-bench."""
    server = make_server(name, gguf_path, args, tmp)
    t0 = time.perf_counter()
    try:
        server.start()
        print(f"[{label}] round {rnd + 1} {name:<5} started in {time.perf_counter() - t0:.1f} s", flush=True)
        asyncio.run(warm_up(server.url))
        for w in args.workloads:
            cpu0 = server.cpu_seconds()
            figures = asyncio.run(WORKLOADS[w](server.url, texts, args))
            figures["server CPU s"] = server.cpu_seconds() - cpu0
            results[w][rnd][name] = figures
            shown = ", ".join(f"{k} {v:.1f}" for k, v in figures.items())
            print(f"[{label}] round {rnd + 1} {name:<5} {w}: {shown}", flush=True)
    except Exception as exc:
        code = server.proc.poll() if server.proc is not None else None
        kept = CACHE / f"failed-{name}-round{rnd + 1}.log"
        kept.write_bytes(server.log.read_bytes())
        failure = f"{type(exc).__name__}: {exc}; exit code {code}"
        print(f"[{label}] round {rnd + 1} {name} FAILED ({failure}); log: {kept}", flush=True)
    finally:
        server.stop()


def run_model(label: str, gguf_path: Path, args: argparse.Namespace) -> None:
    texts = Texts(gguf_path)
    results: Results = {w: [{} for _ in range(args.rounds)] for w in args.workloads}
    with tempfile.TemporaryDirectory(prefix="rsmem-vs-llama-") as tmp:
        for rnd in range(args.rounds):
            for name in ["llama", "rsmem"] if rnd % 2 == 0 else ["rsmem", "llama"]:
                run_server(name, label, rnd, gguf_path, texts, args, Path(tmp), results)
    print(f"\n## {label} ({gguf_path.name}), {SLOTS} slots, {args.threads} threads")
    titles = {
        "a": f"(a) chat {args.conversations} conv x {args.turns} turns, TTFT of turns >= 2",
        "b": f"(b) {args.requests} concurrent completions, prompts 8..{args.max_len} tokens",
        "c": f"(c) 3 short prompts, idle vs 0.2 s after a {args.long_len}-token prompt ({args.reps} reps)",
    }
    for w in args.workloads:
        summarize(titles[w], results[w])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["embedded", "130m", "both"], default="embedded")
    ap.add_argument("--arch130", choices=["mamba", "mamba2"], default="mamba2", help="the 130M model's arch")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2, help="llama-server -t/-tb, rsmem serve -t")
    ap.add_argument("--workloads", default="a,b,c", help="comma-separated subset of a,b,c")
    ap.add_argument("--quick", action="store_true", help="1 round, smaller workloads")
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--long-len", type=int, default=4000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--build-dir", type=Path, default=DEFAULT_BUILD_DIR)
    ap.add_argument("--llama-server", type=Path, default=None, help="a built llama-server (skips the build)")
    args = ap.parse_args()
    args.workloads = [w for w in args.workloads.split(",") if w]
    if args.quick:
        args.rounds, args.turns, args.requests, args.max_len, args.long_len, args.reps = (
            1,
            3,
            16,
            256,
            2000,
            1,
        )
    if args.llama_server is None:
        args.llama_server = ensure_llama_server(args.build_dir.expanduser())
    models = {
        "embedded": [("embedded", embedded_gguf)],
        "130m": [("130m", lambda: random_130m_gguf(args.arch130))],
    }
    models["both"] = models["embedded"] + models["130m"]
    for label, path in models[args.model]:
        run_model(f"{label}" if label == "embedded" else f"{args.arch130} 130M random", path(), args)


if __name__ == "__main__":
    main()
