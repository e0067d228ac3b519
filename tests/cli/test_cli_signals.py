"""Ctrl-C and closed pipes, as a terminal user causes them: real processes, real signals."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rsmem import startup
from rsmem.engine import LLM

pytestmark = pytest.mark.subprocess

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


def test_sigterm_in_generate_is_ctrl_c_saves_the_state_and_exits_143(tmp_path):
    """Issue 37 (13): SIGTERM killed generate with no state and no statistics."""
    state = tmp_path / "s.ggsq"
    run = Running("generate", "ROMEO:", *LONG, "--seed", "1", "--save-state", str(state))
    run.wait_for(lambda r: len(r.out) > 40)  # generating
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 143  # 128 + SIGTERM
    err = run.err.decode()
    assert "Traceback" not in err
    assert re.search(r"\[\d+ prompt tokens, \d+ generated in .* tok/s total\]", err)
    n_tokens, text = saved_text(state)
    assert n_tokens > 10 and text.startswith(run.out.decode()[:40])


def test_sigterm_in_chat_ends_the_reply_saves_and_exits_143(tmp_path):
    state = tmp_path / "talk.ggsq"
    run = Running("chat", *LONG, "--seed", "1", "--save-state", str(state), stdin=True)
    run.send("ROMEO:\n")
    run.wait_for(lambda r: len(r.out) > 40)  # replying
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 143
    err = run.err.decode()
    assert "Traceback" not in err and "saved the conversation" in err
    assert saved_text(state)[1].startswith("ROMEO:\n")


def test_sigterm_in_chat_at_the_prompt_saves_and_exits_143(tmp_path):
    state = tmp_path / "talk.ggsq"
    run = Running("chat", "-n", "3", "--seed", "1", "--save-state", str(state), stdin=True)
    run.send("ROMEO:\n")
    run.wait_for(lambda r: b"tok/s" in r.err or r.out.count(b"\n") >= 1)  # the reply came
    time.sleep(0.3)  # back at the prompt, waiting for a line
    run.proc.send_signal(signal.SIGTERM)
    assert run.finish() == 143
    assert "saved the conversation" in run.err.decode()
    assert saved_text(state)[1].startswith("ROMEO:\n")


@pytest.mark.parametrize("command", [["generate", "ROMEO:"], ["serve", "--port", "0"]])
def test_ctrl_c_while_the_command_starts_exits_130_in_one_line_at_most(command):
    """Issue 37 (13): Ctrl-C while torch loaded printed a 30-line KeyboardInterrupt traceback."""
    proc = subprocess.Popen(
        [sys.executable, "-X", "importtime", "-m", "rsmem.cli", *command],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=ENV,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    err = b""
    while b"torch" not in err:  # -X importtime: a line as each import ends; torch's have begun
        line = proc.stderr.readline()
        assert line, "the command ended before it imported torch"
        err += line
    proc.send_signal(signal.SIGINT)
    rest, _ = proc.communicate(timeout=60)
    said = [line for line in (err + rest).decode().splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 130
    assert len(said) <= 1 and "Traceback" not in said


def test_ctrl_c_while_the_model_compiles_exits_130_at_once():
    """Issue 37 (13): a Ctrl-C during torch.compile's warm-up was raised inside a callback, printed as
    'Exception ignored ... KeyboardInterrupt', and lost: the load went on and the command ran."""
    lfm2 = str(Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp" / "lfm2" / "model-f32.gguf")
    run = Running("generate", "-m", lfm2, "--compile", "1", "hi", *LONG)
    run.wait_for(lambda r: b"[compiling decode steps" in r.err)
    run.interrupt()
    assert run.finish() == 130
    err = run.err.decode()
    assert "KeyboardInterrupt" not in err and "Traceback" not in err and "compiled in" not in err
    assert run.out == b""


SWALLOWED = """
import os, signal, sys, time, weakref
from contextlib import nullcontext
from rsmem.startup import interrupt_exits

class Part:
    pass

with interrupt_exits() if sys.argv[1] == "guarded" else nullcontext():
    part = Part()
    # Ctrl-C arrives while a callback runs, as in torch.compile's warm-up: Python prints and drops
    # whatever the callback raises
    ref = weakref.ref(part, lambda _: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))
    del part
    print("went on")
"""


@pytest.mark.parametrize(("how", "code", "out"), [("plain", 0, "went on\n"), ("guarded", 130, "")])
def test_a_ctrl_c_inside_a_callback_is_lost_unless_it_exits(how, code, out):
    """Why the model loads in interrupt_exits: a KeyboardInterrupt raised inside a callback is lost."""
    r = subprocess.run(
        [sys.executable, "-c", SWALLOWED, how], capture_output=True, text=True, timeout=120, env=ENV
    )
    assert (r.returncode, r.stdout) == (code, out)


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["python", "/venv/bin/rsmem", "generate", "hi"], True),
        (["python", "-m", "rsmem.cli", "serve"], True),
        (["python", "-X", "importtime", "-u", "-m", "rsmem.cli"], True),
        (["python", "-mrsmem.cli"], True),
        (["python", "-m", "pytest", "tests"], False),
        (["python", "-c", "import rsmem"], False),
        (["python", "script.py"], False),
        (["python"], False),
    ],
)
def test_only_the_rsmem_command_exits_on_ctrl_c_while_it_starts(argv, command):
    assert startup.is_command(argv) is command
