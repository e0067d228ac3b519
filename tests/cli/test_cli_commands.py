"""The commands' own options and figures: chat's tokens per second, bench's and the model options' checks,
and progress lines where stderr is not a terminal."""

from __future__ import annotations

import io
import re
import sys
import time

from rsmem.cli import main


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
