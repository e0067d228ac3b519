"""``run_server``: an address that cannot be bound is one error before any banner; SIGINT/SIGTERM stop
accepting, let requests in flight finish or cancel them after ``shutdown_timeout``, log one line, exit 0."""

from __future__ import annotations

import argparse
import io
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from rsmem.engine import LLM
from rsmem.errors import RsmemError
from rsmem.server import ServeOptions, bind_socket, run_server

pytestmark = pytest.mark.subprocess

SCRIPT = """
import sys
from rsmem.engine import LLM
from rsmem.server import ServeOptions, bind_socket, run_server
options = ServeOptions(port=0, shutdown_timeout=float(sys.argv[1]), max_tokens_limit=None, alias="m")
sys.exit(run_server(LLM(n_seq_max=2, n_batch=256), options))
"""


class Served:
    def __init__(self, proc: subprocess.Popen[str], url: str) -> None:
        self.proc, self.url = proc, url
        self.results: list[httpx.Response] = []

    def start_request(self, max_tokens: int) -> threading.Thread:
        eos_ban = {"0": -100}  # token 0 is <|endoftext|> in the default model's tokenizer
        body = {"prompt": "ROMEO:", "max_tokens": max_tokens, "temperature": 0, "logit_bias": eos_ban}
        thread = threading.Thread(
            target=lambda: self.results.append(
                httpx.post(f"{self.url}/v1/completions", json=body, timeout=60)
            )
        )
        thread.start()
        deadline = time.monotonic() + 20
        while not any(s["busy"] for s in httpx.get(f"{self.url}/slots").json()):
            assert time.monotonic() < deadline, "the request did not start"
            time.sleep(0.01)
        return thread

    def finish(self, timeout: float = 30) -> tuple[int, str]:
        rc = self.proc.wait(timeout=timeout)
        assert self.proc.stderr is not None
        return rc, self.proc.stderr.read()


@contextmanager
def served(shutdown_timeout: float) -> Iterator[Served]:
    proc = subprocess.Popen(
        [sys.executable, "-c", SCRIPT, str(shutdown_timeout)], stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stderr is not None
        before = []  # lines before the banner (a first run's kernel build says so on stderr)
        while (line := proc.stderr.readline()) and not line.startswith("rsmem serve:"):
            before.append(line)
        found = re.search(r"on (http://127\.0\.0\.1:\d+) with 2 slots", line)
        assert found, "".join(before) + line
        url = found.group(1)
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.HTTPError:
                assert time.monotonic() < deadline, "the server did not answer"
                time.sleep(0.05)
        yield Served(proc, url)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigint_lets_a_request_in_flight_finish_and_exits_0():
    with served(shutdown_timeout=30) as s:
        thread = s.start_request(max_tokens=300)
        s.proc.send_signal(signal.SIGINT)
        thread.join(timeout=60)
        rc, err = s.finish()
    assert rc == 0, err
    assert s.results[0].status_code == 200
    assert s.results[0].json()["choices"][0]["finish_reason"] == "length"
    assert "Traceback" not in err
    assert "1 request(s) in flight finished, 0 cancelled" in err


def test_sigterm_cancels_what_is_left_after_the_timeout():
    with served(shutdown_timeout=1) as s:
        thread = s.start_request(max_tokens=1_000_000)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        thread.join(timeout=60)
        answered = time.monotonic() - t0
        rc, err = s.finish()
    assert rc == 0, err
    assert 0.9 < answered < 10
    out = s.results[0]
    assert out.status_code == 200 and out.json()["choices"][0]["finish_reason"] == "abort"
    assert out.json()["choices"][0]["text"]  # what was generated so far
    lines = [line for line in err.splitlines() if "stopped" in line]
    assert len(lines) == 1 and "0 request(s) in flight finished, 1 cancelled" in lines[0]
    assert "Traceback" not in err


def test_a_second_sigint_stops_at_once_without_a_traceback():
    with served(shutdown_timeout=60) as s:
        thread = s.start_request(max_tokens=1_000_000)
        t0 = time.monotonic()
        s.proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        with pytest.raises(httpx.ConnectError):  # no new connections once shutting down
            httpx.get(f"{s.url}/health")
        s.proc.send_signal(signal.SIGINT)
        rc, err = s.finish(timeout=20)
        thread.join(timeout=20)
    assert rc == 0 and time.monotonic() - t0 < 15
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert "cancelled at a second signal" in err


def test_a_busy_port_is_one_error_before_any_banner(shared_llm):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = io.StringIO()
        with pytest.raises(RsmemError, match=f"cannot listen on 127.0.0.1:{port}: .*in use"):
            run_server(shared_llm, ServeOptions(port=port), out=out)
        assert out.getvalue() == ""


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (ServeOptions(host="no.such.host.invalid", port=0), "unknown host"),
        (ServeOptions(host="192.0.2.1", port=0), "cannot listen on 192.0.2.1:0"),  # not this machine's
        (ServeOptions(port=70000), "--port 70000"),
        (ServeOptions(port=0, log_level="loud"), "--log-level"),
        (ServeOptions(port=0, prefill_cap=-1), "--prefill-cap -1"),
        (ServeOptions(port=0, rollback_depth=-2), "--rollback-depth -2"),
    ],
)
def test_bad_addresses_and_options_are_one_clear_error(shared_llm, options, message):
    out = io.StringIO()
    with pytest.raises(RsmemError, match=message) as info:
        run_server(shared_llm, options, out=out)
    assert "\n" not in str(info.value) and out.getvalue() == ""


def test_options_from_the_serve_flags():
    args = argparse.Namespace(
        host="127.0.0.1",
        port=9000,
        parallel=4,
        api_key=None,
        slot_save_path="slots",
        max_queue=8,
        max_body_bytes=100,
        max_prompt_tokens=10,
        max_tokens_limit=20,
        alias=None,
        no_prompt_cache=True,
        log_level="info",
        cors_origin=["http://a", "http://b"],
        shutdown_timeout=2.5,
        model=None,
        threads=2,  # other flags are ignored
    )
    options = ServeOptions.from_args(args)
    assert options.cors_origins == ("http://a", "http://b") and options.slot_save_path == Path("slots")
    assert options.port == 9000 and options.shutdown_timeout == 2.5 and options.no_prompt_cache
    assert options.model_path is None


def test_a_socket_bound_before_the_model_loads_is_served():
    """``rsmem serve`` may bind first (a busy port is reported before the model loads), then serve on it;
    a thread that runs the server stops it with ``stop``."""
    sock = bind_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    out, stop, codes = io.StringIO(), threading.Event(), []
    llm = LLM(n_seq_max=2, n_batch=256)

    def serve() -> None:
        codes.append(run_server(llm, ServeOptions(port=0), sock=sock, out=out, stop=stop))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                assert httpx.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline
                time.sleep(0.05)
    finally:
        stop.set()
        thread.join(timeout=30)
    assert codes == [0] and f"127.0.0.1:{port}" in out.getvalue()
    assert "stopped" in out.getvalue().splitlines()[-1]


def test_prefill_cap_and_rollback_depth_flags_reach_the_engine_and_the_context():
    from rsmem.cli import build_parser
    from rsmem.cli.model import load
    from rsmem.server import build_app

    parser = build_parser()
    args = parser.parse_args(["serve", "--prefill-cap", "48", "--rollback-depth", "3", "--parallel", "2"])
    options = ServeOptions.from_args(args)
    assert options.prefill_cap == 48 and options.rollback_depth == 3
    assert ServeOptions.from_args(parser.parse_args(["serve", "--prefill-cap", "auto"])).prefill_cap is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--prefill-cap", "lots"])
    llm = load(args, n_seq_max=2)
    assert llm.context.n_rs_seq == 3
    served = build_app(llm, options)
    try:
        assert served.runner.engine.prefill_cap == 48 and served.runner.engine.pool.rollback_depth == 3
    finally:
        served.runner.stop()


@pytest.mark.parametrize(
    ("env", "flag", "expected"), [(None, None, "1"), ("0", None, "0"), (None, "auto", "auto")]
)
def test_serve_compiles_decode_steps_unless_told_otherwise(monkeypatch, env, flag, expected):
    from rsmem.cli import build_parser
    from rsmem.cli import serve as serve_cli

    if env is None:
        monkeypatch.delenv("RSMEM_COMPILE", raising=False)
    else:
        monkeypatch.setenv("RSMEM_COMPILE", env)
    seen = []

    def fake_load(args, n_seq_max):
        seen.append(args.compile)
        raise RuntimeError("stop before loading")

    monkeypatch.setattr(serve_cli, "load", fake_load)
    argv = ["serve", "--port", "0"] + (["--compile", flag] if flag else [])
    with pytest.raises(RuntimeError, match="stop before loading"):
        serve_cli.cmd_serve(build_parser().parse_args(argv))
    assert seen == [expected]
