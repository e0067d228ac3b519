"""The commands' own options and figures: chat's tokens per second, bench's and the model options' checks,
and progress lines where stderr is not a terminal."""

from __future__ import annotations

import io
import os
import re
import sys
import time

import pytest

from rsmem.cli import chat, generate, main, serve, tools


@pytest.fixture
def no_run(monkeypatch):
    """Fail the test if a command starts its work (for usage errors: they come before any)."""

    def run(args):
        raise AssertionError("the command ran")

    for module, name in (
        (generate, "cmd_generate"),
        (chat, "cmd_chat"),
        (serve, "cmd_serve"),
        (tools, "cmd_bench"),
    ):
        monkeypatch.setattr(module, name, run)


class SlowLines(io.BytesIO):
    """A pipe whose every line arrives ``delay`` seconds after it was asked for (a user typing)."""

    def __init__(self, data: bytes, delay: float) -> None:
        super().__init__(data)
        self.delay = delay

    def readline(self, size: int | None = -1) -> bytes:
        time.sleep(self.delay)
        return super().readline(size)


def test_chat_speed_counts_the_replies_not_the_wait_at_the_prompt(monkeypatch, fast_load, capsys):
    """Issue 37 (14): '58 generated in 8.25s: 7.0 tok/s' counted the time the user took to type."""
    slow = SlowLines(b"ROMEO:\nJULIET:\n", delay=0.6)
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(slow, encoding="utf-8"))
    assert main(["chat", "-n", "4", "--temp", "0"]) == 0
    err = capsys.readouterr().err
    seconds = float(re.search(r"generated in ([\d.]+)s", err).group(1))
    assert seconds < 0.6  # three waits of 0.6 s happened, none of them is counted


# ------------------------------------------------------------------------------------------ bench

BENCH = ["bench", "--skip-130m", "--prompt-tokens", "16", "--steps", "1"]


@pytest.mark.parametrize("parallel", [["0"], ["-2"], ["1", "0"]])
def test_bench_parallel_below_one_is_a_usage_error_before_any_work(parallel, no_run, capsys):
    """Issue 37 (11): the prefill ran, then 'batch has no tokens'."""
    with pytest.raises(SystemExit) as exited:
        main([*BENCH, "--parallel", *parallel])
    assert exited.value.code == 2
    bad = min(int(p) for p in parallel)
    assert f"--parallel must be at least 1, got {bad}" in capsys.readouterr().err


def test_bench_progress_is_plain_lines_where_stderr_is_not_a_terminal(capsys):
    """Issue 37 (11): '\\r\\x1b[K' self-overwriting lines went to logs and pipes."""
    assert main([*BENCH, "--parallel", "1", "-t", "1"]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b" not in err
    assert "default model, t1: prefill 16 tokens\n" in err and "decode, 1 sequences\n" in err


# ------------------------------------------------------------------------------- numbers out of range


@pytest.mark.parametrize("command", [["generate", "hi"], ["chat"], ["serve"], ["bench"]])
def test_threads_above_twice_the_cpus_are_a_usage_error(command, no_run, capsys):
    """Issue 37 (15): -t 1000 ran, 30 times slower than the default."""
    limit = 2 * len(os.sched_getaffinity(0))
    with pytest.raises(SystemExit) as exited:
        main([*command, "-t", str(limit + 1)])
    assert exited.value.code == 2
    assert f"-t {limit + 1}: more than {limit} threads" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--cache-disk", "0", "--cache-disk must be at least 1 (MiB), got 0"),
        ("--alias", "", "--alias must name the model"),
        ("--alias", "  ", "--alias must name the model"),
    ],
)
def test_serve_refuses_an_empty_alias_and_no_disk_budget(flag, value, message, no_run, capsys):
    """Issue 37 (15): accepted silently (an empty alias fell back to the file's name; a budget of 0 MiB
    kept no checkpoint on disk and deleted those the folder held)."""
    with pytest.raises(SystemExit) as exited:
        main(["serve", flag, value])
    assert exited.value.code == 2
    assert message in capsys.readouterr().err
