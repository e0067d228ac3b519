"""Where the time of a streamed chat request goes in ``rsmem serve``: a breakdown table.

The server runs in this process (uvicorn on a thread, the engine on its own thread, as ``rsmem serve``
runs them) and a client on the main thread sends streamed ``/v1/chat/completions`` over loopback. Nothing
under src/ changes: the harness wraps the functions of each stage with timers (``Probe``), and reads each
thread's CPU clock. Two phases:

1. ``single``: C conversations x T turns one request at a time (an idle server), a ~400-word shared system
   prompt, max_tokens 32: the time to first token split into its stages, then the decode phase per token;
   then short (a few tokens) streamed ``/v1/completions`` one at a time, their time to first token;
2. ``load``: the same conversations all at once (as bench/server_vs_llamaserver.py's workload a): each
   thread's CPU time by stage. With ``--py-spy PATH`` a py-spy sampling of this phase also lists the
   functions with the most self time on the engine thread and on the event-loop thread.

Stage times are wall times of the wrapped calls (on 2 cores they include waits for the GIL).

    python bench/server_profile.py [--conversations 3] [--turns 5] [--py-spy /tmp/pyspy-venv/bin/py-spy]
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import uvicorn

import rsmem.engine.engine as engine_module
import rsmem.server.streaming as streaming_module
from rsmem.context import Context
from rsmem.engine import LLM, Engine, IncrementalDetokenizer, Sampler, TextTokenizer, default_model_path
from rsmem.engine.checkpoints import CheckpointCache
from rsmem.server import ServeOptions, build_app
from rsmem.server.chat import ChatTemplate
from rsmem.server.responses import ChatChunks

SENTENCE = "Now is the winter of our discontent made glorious summer by this sun of York. "
QUESTIONS = ["Who art thou?", "Whence comest thou?", "What news?", "Why weep you?", "Where is the king?"]


@dataclass
class Probe:
    """Timers around named functions: each call is one event (stage, thread id, start, end)."""

    events: list[tuple[str, int, float, float]] = field(default_factory=list)
    decoded: list[tuple[float, int]] = field(default_factory=list)  # (start, batch tokens) of each decode

    def wrap(self, owner: Any, attr: str, stage: str) -> None:
        original: Callable[..., Any] | None = getattr(owner, attr, None)
        if original is None:
            print(f"note: {getattr(owner, '__name__', owner)}.{attr} not found; stage {stage!r} not timed")
            return
        events, decoded = self.events, self.decoded

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            if attr == "decode" and len(args) > 1 and hasattr(args[1], "__len__"):
                decoded.append((t0, len(args[1])))
            try:
                return original(*args, **kwargs)
            finally:
                events.append((stage, threading.get_ident(), t0, time.perf_counter()))

        setattr(owner, attr, timed)

    def between(self, t0: float, t1: float) -> list[tuple[str, int, float, float]]:
        return [e for e in self.events if t0 <= e[2] < t1]


STAGES = [  # (owner, attribute, stage)
    (ChatTemplate, "render", "chat template"),
    (ChatTemplate, "message_prefixes", "chat template"),
    (TextTokenizer, "encode", "tokenize"),
    (Engine, "add_request", "validate+queue (add_request)"),
    (Engine, "snapshot", "snapshot (submit's queue check)"),
    (Engine, "step", "engine step"),
    (Context, "decode", "model (Context.decode)"),
    (Sampler, "sample", "sampling"),
    (IncrementalDetokenizer, "push", "detokenize"),
    (engine_module, "plan_step", "scheduling"),
    (engine_module, "build_batch", "scheduling"),
    (engine_module, "report", "reports"),
    (CheckpointCache, "take", "prefix cache"),
    (CheckpointCache, "restore_best", "prefix cache"),
    (CheckpointCache, "positions", "prefix cache"),
    (ChatChunks, "chunks", "chunk dicts"),
    (streaming_module, "sse", "JSON + SSE encode"),
]
THREAD_NAMES = ("rsmem-engine", "uvicorn")
ENGINE_INNER = ["model (Context.decode)", "sampling", "detokenize", "scheduling", "reports", "prefix cache"]


def thread_cpu(ident: int) -> float:
    return time.clock_gettime(time.pthread_getcpuclockid(ident))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Sample:
    t_send: float
    t_first: float
    t_end: float
    chunk_times: list[float]
    text: str
    prompt: int = 0
    cached: int = 0


def ask(client: httpx.Client, url: str, messages: list[dict[str, str]]) -> Sample:
    body = {"messages": messages, "max_tokens": 32, "temperature": 0, "stream": True, "seed": 1}
    body["stream_options"] = {"include_usage": True}
    t_send = time.perf_counter()
    times: list[float] = []
    text, usage = "", {}
    with client.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if delta:
                    times.append(time.perf_counter())
                    text += delta
    end = time.perf_counter()
    sample = Sample(t_send, times[0] if times else end, end, times, text)
    sample.prompt = usage.get("prompt_tokens", 0)
    sample.cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
    return sample


def ask_short(client: httpx.Client, url: str, prompt: str) -> Sample:
    """A streamed completion of a short prompt (max_tokens 8)."""
    body = {"prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True, "seed": 1}
    body["stream_options"] = {"include_usage": True}
    t_send = time.perf_counter()
    times: list[float] = []
    text, usage = "", {}
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                piece = chunk["choices"][0]["text"] if chunk["choices"] else None
                if piece:
                    times.append(time.perf_counter())
                    text += piece
    end = time.perf_counter()
    return Sample(t_send, times[0] if times else end, end, times, text, usage.get("prompt_tokens", 0), 0)


def conversation(client: httpx.Client, url: str, k: int, turns: int, system: str, out: list[Sample]) -> None:
    messages = [{"role": "system", "content": system}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"{QUESTIONS[(k + turn) % 5]} ({k}.{turn})"})
        s = ask(client, url, messages)
        if turn >= 1:
            out.append(s)
        messages.append({"role": "assistant", "content": s.text})


def ttft_breakdown(probe: Probe, s: Sample, engine_tid: int) -> dict[str, float]:
    """One idle-server request's time to first token, stage by stage (ms). A completion request has no
    chat template and is tokenised inside ``add_request``, on the engine thread."""
    ev = probe.between(s.t_send, s.t_first)
    add = [e for e in ev if e[0] == "validate+queue (add_request)"]
    sampled = [e for e in ev if e[0] == "sampling"]
    if not add or not sampled:
        return {}
    # the prefill steps: up to the one whose sampling gave the first token
    steps = [e for e in ev if e[0] == "engine step" and e[2] <= sampled[0][2]]
    ev = [e for e in ev if e[2] < steps[-1][3]]
    template = [e for e in ev if e[0] == "chat template"]
    loop_encode = [e for e in ev if e[0] == "tokenize" and e[1] != engine_tid]
    engine_encode = [e for e in ev if e[0] == "tokenize" and e[1] == engine_tid]
    inner = {name: sum(e[3] - e[2] for e in ev if e[0] == name) for name in ENGINE_INNER}
    step_total = sum(e[3] - e[2] for e in steps)
    if template:
        ms = {
            "HTTP receive + JSON + pydantic, until the handler": template[0][2] - s.t_send,
            "chat template (render + message prefixes)": template[-1][3] - template[0][2],
            "tokenize (prompt + each message prefix, event loop)": sum(e[3] - e[2] for e in loop_encode),
            "hand-off to the engine thread (runner.call)": add[0][2]
            - (loop_encode[-1][3] if loop_encode else template[-1][3]),
        }
    else:
        ms = {"HTTP receive + JSON + pydantic + hand-off to the engine thread": add[0][2] - s.t_send}
    ms["validate + queue (Engine.add_request)"] = add[0][3] - add[0][2]
    ms["  of which tokenize (engine thread)"] = sum(e[3] - e[2] for e in engine_encode)
    ms["add -> first step (engine loop wake, admit)"] = steps[0][2] - add[0][3]
    ms |= {f"prefill steps: {k}": v for k, v in inner.items()}
    ms["prefill steps: engine other (admit, commit, bookkeeping)"] = step_total - sum(inner.values())
    ms["between prefill steps (runner loop)"] = (steps[-1][3] - steps[0][2]) - step_total
    ms["first token's step end -> client has text (deliver, SSE, HTTP; held-back text)"] = (
        s.t_first - steps[-1][3]
    )
    ms["= TTFT"] = s.t_first - s.t_send
    batches = [n for t, n in probe.decoded if steps[0][2] <= t <= steps[-1][3]]
    counts = {"(prefill steps)": len(steps), "(prefill tokens computed)": sum(batches)}
    return {k: 1e3 * v for k, v in ms.items()} | counts | {"(prompt tokens)": s.prompt, "(cached)": s.cached}


def decode_breakdown(probe: Probe, s: Sample) -> dict[str, float]:
    """The decode phase of one idle-server request, per generated chunk (ms)."""
    ev = probe.between(s.t_first, s.t_end)
    n = max(len(s.chunk_times) - 1, 1)
    steps = [e for e in ev if e[0] == "engine step"]
    step_total = sum(e[3] - e[2] for e in steps)
    inner = {name: sum(e[3] - e[2] for e in ev if e[0] == name) for name in ENGINE_INNER}
    ms = {f"step: {k}": v / n for k, v in inner.items()}
    ms["step: engine other (admit, commit, bookkeeping)"] = (step_total - sum(inner.values())) / n
    ms["outside steps (runner loop, deliver, GIL waits)"] = ((s.t_end - s.t_first) - step_total) / n
    ms["  of which chunk dicts (event loop)"] = sum(e[3] - e[2] for e in ev if e[0] == "chunk dicts") / n
    ms["  of which JSON + SSE encode (event loop)"] = (
        sum(e[3] - e[2] for e in ev if e[0] == "JSON + SSE encode") / n
    )
    ms["= inter-chunk time"] = (s.t_end - s.t_first) / n
    return {k: 1e3 * v for k, v in ms.items()} | {"(engine steps per chunk)": len(steps) / n}


def print_table(title: str, rows: list[dict[str, float]]) -> None:
    print(f"\n{title} (median over {len(rows)} requests)")
    print("| stage | ms | share |")
    print("|---|---|---|")
    total = statistics.median(r[next(k for k in r if k.startswith("="))] for r in rows)
    for key in rows[0]:
        v = statistics.median(r[key] for r in rows)
        share = "" if key.startswith(("=", "(")) else f"{v / total:.0%}"
        print(f"| {key} | {v:.2f} | {share} |")


def load_phase(probe: Probe, url: str, args: argparse.Namespace, system: str, tids: dict[str, int]) -> None:
    cpu0 = {name: thread_cpu(t) for name, t in tids.items()}
    n0 = len(probe.events)
    spy = None
    raw = Path(tempfile.mkdtemp()) / "spy.txt"
    if args.py_spy:
        cmd = [args.py_spy, "record", "--pid", str(os.getpid()), "--format", "raw", "--threads", "-r", "100"]
        spy = subprocess.Popen([*cmd, "-o", str(raw), "--nonblocking"], stderr=subprocess.DEVNULL)
        time.sleep(1.0)
    t0 = time.perf_counter()
    with httpx.Client(timeout=600) as client:
        threads = [
            threading.Thread(target=conversation, args=(client, url, 100 + k, args.turns, system, []))
            for k in range(args.conversations)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    wall = time.perf_counter() - t0
    cpu = {name: thread_cpu(t) - cpu0[name] for name, t in tids.items()}
    if spy is not None:
        spy.send_signal(2)
        spy.wait(timeout=30)
    ev = probe.events[n0:]
    print(f"\nload: {args.conversations} conversations x {args.turns} turns at once, wall {wall:.2f} s")
    print("(thread CPU: the thread's own clock; torch's worker threads are not the engine thread's)")
    print("| thread | stage | s | share of wall |")
    print("|---|---|---|---|")
    for name, stages in (("engine", ["engine step", *ENGINE_INNER]), ("loop", None)):
        tid = tids[name]
        mine = [e for e in ev if e[1] == tid]
        names = stages or sorted({e[0] for e in mine})
        print(f"| {name} | thread CPU | {cpu[name]:.2f} | {cpu[name] / wall:.0%} |")
        for stage in names:
            v = sum(e[3] - e[2] for e in mine if e[0] == stage)
            print(f"| {name} | {stage} | {v:.3f} | {v / wall:.0%} |")
    if spy is not None and raw.exists():
        top_functions(raw)


def top_functions(raw: Path, n: int = 15) -> None:
    """Self time by function, and inclusive time of rsmem's functions, per thread, from py-spy's raw
    (collapsed) output, whose first frame names the thread."""
    leaf: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    inclusive: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        thread = next((name for name in THREAD_NAMES if frames[0].endswith(f": {name}")), "client")
        leaf[thread][frames[-1]] += int(count)
        for frame in {f for f in frames[1:] if "rsmem/" in f}:
            inclusive[thread][frame] += int(count)
    for thread in THREAD_NAMES:
        total = sum(leaf[thread].values()) or 1
        print(f"\npy-spy: {thread} thread, {total} samples; self time:")
        for frame, c in leaf[thread].most_common(n):
            print(f"  {c / total:6.1%}  {frame}")
        print("inclusive time of rsmem functions:")
        for frame, c in inclusive[thread].most_common(n):
            print(f"  {c / total:6.1%}  {frame}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=3)
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--system-words", type=int, default=400)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--shorts", type=int, default=10, help="short completion requests, one at a time")
    ap.add_argument("--py-spy", default=None, help="py-spy binary: also sample the load phase")
    ap.add_argument("--compile", default="1", help="decode steps through torch.compile (serve's default: 1)")
    args = ap.parse_args()
    probe = Probe()
    for owner, attr, stage in STAGES:
        probe.wrap(owner, attr, stage)
    llm = LLM(default_model_path(), n_seq_max=4, n_batch=512, n_threads=args.threads, compile=args.compile)
    warm_up = getattr(llm.model, "warm_up", None)
    if getattr(llm.model, "compile_decode", False) and callable(warm_up):  # as rsmem serve: before serving
        print(f"compiled decode steps in {warm_up():.1f} s")
    served = build_app(llm, ServeOptions(parallel=4, model_path=default_model_path()))
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(served.app, host="127.0.0.1", port=port, log_level="warning"))
    loop_thread = threading.Thread(target=server.run, daemon=True, name="uvicorn")
    loop_thread.start()
    while not server.started:
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    words = SENTENCE.split()
    system = " ".join(words[i % len(words)] for i in range(args.system_words))
    engine_thread = next(t for t in threading.enumerate() if t.name == "rsmem-engine")
    assert loop_thread.ident is not None and engine_thread.ident is not None
    tids = {"engine": engine_thread.ident, "loop": loop_thread.ident}
    try:
        samples: list[Sample] = []
        with httpx.Client(timeout=600) as client:
            ask(client, url, [{"role": "user", "content": "warm up"}])
            for k in range(args.conversations):
                conversation(client, url, k, args.turns, system, samples)
        rows = [r for r in (ttft_breakdown(probe, s, tids["engine"]) for s in samples) if r]
        print_table("single: time to first token, turns >= 2, idle server", rows)
        print_table("single: decode phase, per streamed chunk", [decode_breakdown(probe, s) for s in samples])
        with httpx.Client(timeout=600) as client:
            shorts = [ask_short(client, url, f"{QUESTIONS[k % 5]} ({k})") for k in range(args.shorts)]
        rows = [r for r in (ttft_breakdown(probe, s, tids["engine"]) for s in shorts) if r]
        print_table("single: time to first token of a short /v1/completions prompt, idle server", rows)
        load_phase(probe, url, args, system, tids)
    finally:
        server.should_exit = True
        loop_thread.join(timeout=30)
        served.runner.stop()


if __name__ == "__main__":
    main()
