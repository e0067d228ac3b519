"""``generate`` and ``chat`` on hybrid models, whose KV cache bounds what a sequence holds: a reply that
fills the context ends there with its state saved, and a chat line that does not fit is refused while the
conversation goes on."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rsmem.cli import main
from rsmem.engine import LLM

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "llamacpp"
LFM2 = str(FIXTURES / "lfm2" / "model-f32.gguf")
QWEN35 = str(FIXTURES / "qwen35" / "model-f32.gguf")
CELLS = 256  # a sequence's KV cells at -c 64 and -c 100: a share of -c, rounded up to 256 (llama.cpp's)
NO_END = ["--ignore-eos", "--stop", "ZZZZ", "--seed", "1"]  # only the length ends a reply


def saved_tokens(model: str, path: Path) -> int:
    return len(LLM(model, n_seq_max=1).engine.open_session(str(path)).tokens)


@pytest.mark.parametrize("model", [LFM2, QWEN35])
def test_generate_save_state_that_fills_the_context_ends_there_and_saves(model, tmp_path, capsys):
    """Issue 37 (4): the reply's last token, decoded at the save, found no cell; nothing was saved."""
    state = tmp_path / "x.ggsq"
    argv = ["generate", "-m", model, "-c", "64", "-p", "hi", "-n", "400", *NO_END]
    assert main([*argv, "--save-state", str(state)]) == 0
    err = capsys.readouterr().err
    assert f"[saved {CELLS} tokens of state to {state}" in err
    assert "[the context is full" in err
    assert re.search(r"\d+ generated in .* tok/s total\]", err)
    assert saved_tokens(model, state) == CELLS
    # a full conversation takes no more: refused, naming the context, the file untouched
    assert main(["generate", "-m", model, "-c", "64", "-p", " more", "--load-state", str(state)]) == 1
    assert "more than the max context" in capsys.readouterr().err


def test_chat_refuses_a_line_that_does_not_fit_and_goes_on(tmp_path, stdin_bytes, capsys):
    """Issue 37 (5): a line that outgrew the context ended chat with exit 1 and no saved state."""
    state = tmp_path / "lc.ggsq"
    stdin_bytes(("hi\n" + "word " * 300 + "\nhello\n").encode())
    assert main(["chat", "-m", LFM2, "-c", "100", "-n", "30", *NO_END, "--save-state", str(state)]) == 0
    err = capsys.readouterr().err
    refused = [line for line in err.splitlines() if line.startswith("rsmem: error:")]
    assert len(refused) == 1 and "more than the max context" in refused[0]
    assert "not sent" in refused[0]
    assert "saved the conversation" in err
    # two lines and their replies of 30 tokens: the refused line left nothing in the state
    n = saved_tokens(LFM2, state)
    assert 60 < n < 120


def test_chat_that_fills_the_context_refuses_further_lines_and_saves(tmp_path, stdin_bytes, capsys):
    state = tmp_path / "full.ggsq"
    stdin_bytes(b"hi\nmore\nstill more\n")
    assert main(["chat", "-m", LFM2, "-c", "100", "-n", "400", *NO_END, "--save-state", str(state)]) == 0
    err = capsys.readouterr().err
    assert len([line for line in err.splitlines() if line.startswith("rsmem: error:")]) == 2
    assert f"saved the conversation ({CELLS} tokens)" in err and err.count("[the context is full") == 1
    assert saved_tokens(LFM2, state) == CELLS
