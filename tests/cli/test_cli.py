"""The ``rsmem`` command line, run as a user would: in a subprocess, with the embedded default model."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rsmem.engine import default_model_path

pytestmark = pytest.mark.subprocess

ENV = os.environ | {"PYTHONUNBUFFERED": "1"}


def rsmem(*args: str, stdin: str | None = None, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "rsmem.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=ENV,
    )


def test_default_model_is_shipped():
    path = default_model_path()
    assert path.is_file()
    assert path.stat().st_size < 16_000_000


def test_generate_with_the_default_model():
    r = rsmem("generate", "ROMEO:", "-n", "24", "--seed", "1")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:")
    words = r.stdout[len("ROMEO:") :].split()
    assert len(words) >= 3  # it writes words, not nothing
    assert "tok/s" in r.stderr


def test_save_and_load_state_continue_without_reprocessing(tmp_path):
    state = tmp_path / "s.ggsq"
    first = rsmem("generate", "ROMEO:", "-n", "8", "--temp", "0", "--save-state", str(state))
    assert first.returncode == 0, first.stderr
    assert state.is_file() and "saved" in first.stderr
    resumed = rsmem("generate", " And", "-n", "8", "--temp", "0", "--load-state", str(state))
    assert resumed.returncode == 0, resumed.stderr
    assert "restored" in resumed.stderr
    # only the new text was processed: " And" plus the pending token is a handful of prompt tokens
    prompt_tokens = int(resumed.stderr.split("[")[-1].split(" prompt tokens")[0])
    assert prompt_tokens <= 4


def test_chat_carries_state_between_turns():
    r = rsmem("chat", "-n", "10", "--temp", "0", stdin="ROMEO:\nJULIET:\n")
    assert r.returncode == 0, r.stderr
    assert "prompt tokens" in r.stderr


def test_info_reports_architecture_and_state_size():
    r = rsmem("info")
    assert r.returncode == 0, r.stderr
    assert "architecture:    mamba" in r.stdout
    assert "state per seq:" in r.stdout and "parameters:" in r.stdout
    assert "decode steps:    eager" in r.stdout  # the small embedded model is below the compile threshold
    assert "malloc:          freed blocks kept for reuse" in r.stdout
    # the embedded model's F16 matrices need the kernels, so they are loaded, with the default wait
    assert "products:        rsmem's workers, spinning up to 200 us while the core is idle" in r.stdout


def test_generate_accepts_compile_off():
    r = rsmem("generate", "ROMEO:", "-n", "4", "--seed", "1", "--compile", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("ROMEO:")


def test_corrupt_model_file_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 20)
    r = rsmem("generate", "hi", "-m", str(bad))
    assert r.returncode == 1
    assert r.stderr.strip().startswith("rsmem: error:") and "Traceback" not in r.stderr


def test_corrupt_state_file_is_one_clear_line(tmp_path):
    bad = tmp_path / "bad.ggsq"
    bad.write_bytes(Path(__file__).read_bytes()[:100])
    r = rsmem("generate", "hi", "--load-state", str(bad))
    assert r.returncode == 1
    assert "not a sequence state file" in r.stderr and "Traceback" not in r.stderr


Q4_K = Path(__file__).parents[1] / "fixtures" / "llamacpp" / "quant" / "mamba" / "model-q4_k_m.gguf"


def test_info_on_a_quantized_file_says_which_products_its_blocks_get():
    """Issue 37 (12): 'kept in its blocks (rsmem's kernels)' beside 'products: torch's (the C++ kernels are
    not loaded)': info never ran a product, which is what loads the kernels."""
    r = rsmem("info", str(Q4_K))
    assert r.returncode == 0, r.stderr
    assert "Q4_K      4 tensors" in r.stdout and "kept in its blocks (rsmem's kernels)" in r.stdout
    assert "products:        rsmem's workers" in r.stdout


def test_info_without_the_kernels_says_torch_multiplies_the_blocks():
    r = subprocess.run(
        [sys.executable, "-m", "rsmem.cli", "info", str(Q4_K)],
        capture_output=True,
        text=True,
        timeout=240,
        env=ENV | {"RSMEM_KERNELS": "0"},
    )
    assert r.returncode == 0, r.stderr
    assert "rsmem's kernels" not in r.stdout and "kept in its blocks" in r.stdout
    assert "products:        torch's, from the blocks" in r.stdout and "RSMEM_KERNELS=0" in r.stdout
