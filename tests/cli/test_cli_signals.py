"""Ctrl-C and closed pipes, as a terminal user causes them: real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from rsmem.engine import LLM

ENV = os.environ | {"PYTHONUNBUFFERED": "1"}
# no end before the test stops it: no EOS, and no "\n\n" (chat's default stop)
LONG = ["-n", "5000", "--ignore-eos", "--stop", "ZZZZ"]


class Running:
    """An ``rsmem`` process whose stdout and stderr are collected by threads (no pipe can fill up)."""

    def __init__(self, *args: str, stdin: bool = False) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rsmem.cli", *args],
            stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=ENV,
            # as a terminal's shell starts it: SIGINT at its default, even where this test runs with it
            # ignored (a background job of a non-interactive shell), which the child would inherit
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
        self.out = bytearray()
        self.err = bytearray()
        self._threads = [
            threading.Thread(target=self._drain, args=(self.proc.stdout, self.out), daemon=True),
            threading.Thread(target=self._drain, args=(self.proc.stderr, self.err), daemon=True),
        ]
        for t in self._threads:
            t.start()

    @staticmethod
    def _drain(stream, into: bytearray) -> None:
        while chunk := stream.read1(4096):
            into.extend(chunk)

    def wait_for(self, what, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not what(self):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                pytest.fail(f"never happened; stdout {bytes(self.out)!r}, stderr {bytes(self.err)!r}")
            time.sleep(0.05)

    def send(self, text: str) -> None:
        self.proc.stdin.write(text.encode())
        self.proc.stdin.flush()

    def interrupt(self) -> None:
        self.proc.send_signal(signal.SIGINT)

    def finish(self, timeout: float = 60) -> int:
        code = self.proc.wait(timeout)
        for t in self._threads:
            t.join(timeout)
        return code


def saved_text(path) -> tuple[int, str]:
    """(tokens, their text) of a saved state file."""
    llm = LLM(n_seq_max=1)
    tokens = llm.engine.open_session(str(path)).tokens
    return len(tokens), llm.tokenizer.decode(tokens)


def test_ctrl_c_in_generate_prints_statistics_saves_the_state_and_exits_130(tmp_path):
    state = tmp_path / "s.ggsq"
    run = Running("generate", "ROMEO:", *LONG, "--seed", "1", "--save-state", str(state))
    run.wait_for(lambda r: len(r.out) > 40)  # generating
    run.interrupt()
    assert run.finish() == 130
    err = run.err.decode()
    assert "Traceback" not in err
    assert re.search(r"\[\d+ prompt tokens, \d+ generated in .* tok/s total\]", err)
    assert f"to {state}" in err and state.is_file()
    n_tokens, text = saved_text(state)
    assert n_tokens > 10 and text.startswith("ROMEO:")  # the prompt and what came before Ctrl-C
    out = run.out.decode()
    assert out.endswith("\n") and text.startswith(out[:40])


def test_ctrl_c_in_chat_stops_the_reply_and_a_second_at_the_prompt_saves_and_exits_0(tmp_path):
    state = tmp_path / "talk.ggsq"
    run = Running("chat", *LONG, "--seed", "1", "--save-state", str(state), stdin=True)
    run.send("ROMEO:\n")
    run.wait_for(lambda r: len(r.out) > 40)  # replying
    run.interrupt()
    run.wait_for(lambda r: b"[interrupted]" in r.err)  # back at the prompt, the reply cut short
    replied = len(run.out)
    run.send("JULIET:\n")  # the conversation goes on
    run.wait_for(lambda r: len(r.out) > replied + 40)
    run.interrupt()
    run.wait_for(lambda r: r.err.count(b"[interrupted]") == 2)
    run.interrupt()  # at the prompt: quit, saving the conversation
    assert run.finish() == 0
    err = run.err.decode()
    assert "Traceback" not in err and "saved the conversation" in err
    n_tokens, text = saved_text(state)  # both lines, and the replies cut short
    assert text.startswith("ROMEO:\n") and "JULIET:\n" in text and n_tokens > 20


def test_a_closed_stdout_pipe_ends_quietly():
    run = subprocess.Popen(
        [sys.executable, "-m", "rsmem.cli", "generate", "ROMEO:", "-n", "3000", "--ignore-eos"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
    )
    assert run.stdout.read(10)  # as `| head -c 10`: read a little, then close the pipe
    run.stdout.close()
    err = run.stderr.read()
    assert run.wait(120) == 141  # 128 + SIGPIPE, as a shell reports a program a closed pipe stopped
    assert err == b""
