"""The thread policy: OpenMP's wait policy set before torch loads, and threads chosen by the model."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import rsmem
from rsmem import threads
from rsmem.engine import default_model_path

pytestmark = pytest.mark.subprocess

OMP_VARS = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "RSMEM_OMP_PASSIVE", "RSMEM_THREADS", "OMP_DISPLAY_ENV")


def _run(code: list[str], **env: str) -> tuple[str, str]:
    """Run ``python *code`` with libgomp printing its settings as it loads: (spin count, stdout)."""
    clean = {k: v for k, v in os.environ.items() if k not in OMP_VARS}
    proc = subprocess.run(
        [sys.executable, *code],
        env=clean | {"OMP_DISPLAY_ENV": "VERBOSE"} | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    spin = re.search(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr)
    assert spin, proc.stderr[-2000:]
    return spin.group(1), proc.stdout.strip()


def test_import_rsmem_makes_openmp_threads_sleep() -> None:
    # libgomp's own report: a spin count of 0 is OMP_WAIT_POLICY=PASSIVE; 300000 is its default
    spin, out = _run(["-c", "import rsmem; print(rsmem.threads.wait_policy())"])
    assert (spin, out) == ("0", "passive")


def test_the_policy_stays_in_rsmem_s_own_process() -> None:
    """Once torch has loaded, the environment is the user's again: a program started from a process that
    imported rsmem keeps OpenMP's default (it spins), while rsmem's own threads still sleep."""
    child = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import torch'], check=True)"
    code = f"import os, rsmem; print(os.environ.get('OMP_WAIT_POLICY')); {child}"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        env={k: v for k, v in os.environ.items() if k not in OMP_VARS} | {"OMP_DISPLAY_ENV": "VERBOSE"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    assert proc.stdout.strip() == "None"
    assert re.findall(r"GOMP_SPINCOUNT = '(\d+)'", proc.stderr) == ["0", "300000"]  # rsmem's, the child's


def test_the_command_line_sets_it_before_torch_loads() -> None:
    spin, _ = _run(["-m", "rsmem.cli", "--help"])
    assert spin == "0"


def test_torch_imported_first_keeps_its_default_and_says_so() -> None:
    spin, out = _run(["-c", "import torch, rsmem; print(rsmem.threads.wait_policy())"])
    assert (spin, out) == ("300000", "too late")
    spin, out = _run(
        ["-c", "import torch, rsmem; print(rsmem.threads.wait_policy())"], OMP_WAIT_POLICY="PASSIVE"
    )
    assert (spin, out) == ("0", "user")  # the documented remedy: the policy in the environment


@pytest.mark.parametrize(
    ("env", "spin", "policy"),
    [
        ({"OMP_WAIT_POLICY": "ACTIVE"}, "30000000000", "user"),
        ({"GOMP_SPINCOUNT": "1000"}, "1000", "user"),
        ({"RSMEM_OMP_PASSIVE": "0"}, "300000", "off"),
    ],
)
def test_the_users_choice_is_left_alone(env: dict[str, str], spin: str, policy: str) -> None:
    assert _run(["-c", "import rsmem; print(rsmem.threads.wait_policy())"], **env) == (spin, policy)


def _model(width: int) -> object:
    return SimpleNamespace(config=SimpleNamespace(d_model=width))


def test_auto_threads_by_policy_and_width() -> None:
    cores = threads.all_cores()
    small, large = _model(threads.SMALL_MODEL_WIDTH - 1), _model(threads.SMALL_MODEL_WIDTH)
    assert threads.auto_threads(small, passive=True) == cores  # type: ignore[arg-type]
    assert threads.auto_threads(large, passive=True) == cores  # type: ignore[arg-type]
    assert threads.auto_threads(small, passive=False) == 1  # type: ignore[arg-type]
    assert threads.auto_threads(large, passive=False) == cores  # type: ignore[arg-type]
    assert threads.auto_threads(SimpleNamespace(), passive=False) == cores  # type: ignore[arg-type]


def test_explicit_threads_then_environment_then_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model(256)
    monkeypatch.delenv("RSMEM_THREADS", raising=False)
    assert threads.choose_threads(model, 3) == 3  # type: ignore[arg-type]
    assert threads.choose_threads(model) == threads.auto_threads(model)  # type: ignore[arg-type]
    monkeypatch.setenv("RSMEM_THREADS", "5")
    assert threads.choose_threads(model) == 5  # type: ignore[arg-type]
    assert threads.choose_threads(model, 2) == 2  # type: ignore[arg-type]
    monkeypatch.setenv("RSMEM_THREADS", "auto")
    assert threads.choose_threads(model) == threads.auto_threads(model)  # type: ignore[arg-type]
    for bad in ("0", "two"):
        monkeypatch.setenv("RSMEM_THREADS", bad)
        with pytest.raises(ValueError, match="RSMEM_THREADS must be 'auto' or a number >= 1"):
            threads.choose_threads(model)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads must be at least 1"):
        threads.choose_threads(model, 0)  # type: ignore[arg-type]


@pytest.fixture
def keep_threads() -> object:
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("keep_threads")
def test_load_model_applies_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RSMEM_THREADS", raising=False)
    torch.set_num_threads(threads.all_cores())
    model = rsmem.load_model(default_model_path(), n_threads=1)
    assert torch.get_num_threads() == 1
    rsmem.load_model(default_model_path())
    assert torch.get_num_threads() == threads.auto_threads(model)
    monkeypatch.setenv("RSMEM_THREADS", "1")
    torch.set_num_threads(threads.all_cores())
    rsmem.load_model(default_model_path())
    assert torch.get_num_threads() == 1


@pytest.mark.usefixtures("keep_threads")
def test_llm_applies_the_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    from rsmem.engine import LLM

    monkeypatch.setenv("RSMEM_THREADS", "1")
    torch.set_num_threads(threads.all_cores())
    llm = LLM(n_seq_max=1)  # the embedded model, loaded from its file
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads.all_cores())
    LLM(llm.model, tokenizer=llm.tokenizer, n_seq_max=1)  # a model object
    assert torch.get_num_threads() == 1
    LLM(llm.model, tokenizer=llm.tokenizer, n_seq_max=1, n_threads=2)
    assert torch.get_num_threads() == 2


@pytest.mark.usefixtures("keep_threads")
def test_bench_threads_flag(capsys: pytest.CaptureFixture[str]) -> None:
    from rsmem.cli import main

    args = ["bench", "--skip-130m", "--prompt-tokens", "16", "--steps", "1", "--parallel", "1"]
    assert main([*args, "-t", "1"]) == 0
    out = capsys.readouterr().out
    assert "default model, t1 " in out
    assert f"OpenMP wait policy: {threads.wait_policy()}" in out


@pytest.mark.usefixtures("keep_threads")
def test_generate_threads_flag_and_default(monkeypatch: pytest.MonkeyPatch) -> None:
    from rsmem.cli import main

    monkeypatch.delenv("RSMEM_THREADS", raising=False)
    args = ["generate", "ROMEO:", "-n", "2", "--seed", "1"]
    assert main([*args, "-t", "1"]) == 0
    assert torch.get_num_threads() == 1
    torch.set_num_threads(threads.all_cores())
    assert main([*args, "-t", "2"]) == 0
    assert torch.get_num_threads() == 2
    torch.set_num_threads(3)
    assert main(args) == 0  # chosen by the model
    model = rsmem.load_model(default_model_path(), n_threads=1)
    assert torch.get_num_threads() == 1
    assert main(args) == 0
    assert torch.get_num_threads() == threads.auto_threads(model)


def test_info_shows_threads_and_wait_policy(capsys: pytest.CaptureFixture[str]) -> None:
    from rsmem.cli import main

    assert main(["info"]) == 0
    model = rsmem.load_model(default_model_path(), n_threads=torch.get_num_threads())
    want = f"threads:         {threads.choose_threads(model)} (RSMEM_THREADS / -t, else by the model), "
    assert want + f"OpenMP wait policy: {threads.wait_policy()}" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("text", "others"), [("0.52 0.31 0.20 3/120 4567\n", 2), ("0.0 0.0 0.0 1/80 99\n", 0), ("garbage", 0)]
)
def test_others_runnable_reads_the_loadavg_count(tmp_path, text: str, others: int) -> None:
    path = tmp_path / "loadavg"
    path.write_text(text)
    assert threads.others_runnable(str(path)) == others
    assert threads.others_runnable(str(tmp_path / "missing")) == 0


@pytest.fixture
def busy_neighbour(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    """The automatic count on sleeping threads, with another process's thread runnable (as loadavg says)."""
    monkeypatch.setattr(threads, "_auto_count", True)
    monkeypatch.setattr(threads, "_PASSIVE", True)
    monkeypatch.setattr(threads, "others_runnable", lambda path=threads.LOADAVG: 1)
    monkeypatch.delenv("RSMEM_BUSY_THREADS", raising=False)
    torch.set_num_threads(threads.all_cores())
    return monkeypatch


def test_prompt_work_beside_a_busy_process_gets_twice_the_cores(busy_neighbour: pytest.MonkeyPatch) -> None:
    cores = threads.all_cores()
    with threads.prompt_threads(threads.PROMPT_TOKENS):
        assert torch.get_num_threads() == 2 * cores
    assert torch.get_num_threads() == cores
    with pytest.raises(RuntimeError), threads.prompt_threads(512):
        raise RuntimeError("a failing micro-batch")
    assert torch.get_num_threads() == cores  # restored on errors too


def test_compiled_code_in_a_raised_prompt_runs_unraised(busy_neighbour: pytest.MonkeyPatch) -> None:
    """unraised_threads (around every compiled call): the count before the raise inside prompt_threads,
    nothing changed elsewhere, and nothing left of a raise that ended in an error."""
    cores = threads.all_cores()
    with threads.prompt_threads(512):
        with threads.unraised_threads():
            assert torch.get_num_threads() == cores
        assert torch.get_num_threads() == 2 * cores
    with pytest.raises(RuntimeError), threads.prompt_threads(512), threads.unraised_threads():
        raise RuntimeError("a failing compiled call")
    torch.set_num_threads(1)  # a count other than the raise's start: a stale raise would change it
    try:
        with threads.unraised_threads():
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(cores)


@pytest.mark.parametrize("case", ["decode", "quiet", "user count", "spinning", "turned off"])
def test_prompt_threads_leave_the_count_alone(busy_neighbour: pytest.MonkeyPatch, case: str) -> None:
    tokens = threads.PROMPT_TOKENS - 1 if case == "decode" else 512
    if case == "quiet":
        busy_neighbour.setattr(threads, "others_runnable", lambda path=threads.LOADAVG: 0)
    elif case == "user count":
        busy_neighbour.setattr(threads, "_auto_count", False)
    elif case == "spinning":
        busy_neighbour.setattr(threads, "_PASSIVE", False)
    else:
        busy_neighbour.setenv("RSMEM_BUSY_THREADS", "0")
    with threads.prompt_threads(tokens):
        assert torch.get_num_threads() == threads.all_cores()


def test_a_prompt_runs_on_twice_the_cores_beside_a_busy_process(busy_neighbour: pytest.MonkeyPatch) -> None:
    from rsmem import Batch, Context
    from rsmem.models.mamba.mamba1 import MambaConfig
    from rsmem.models.mamba.random_init import random_mamba

    model = random_mamba(MambaConfig(d_model=32, n_layer=2, n_vocab=64, d_state=8, dt_rank=4), seed=2)
    seen: list[int] = []
    forward = model.forward

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return forward(*args, **kwargs)

    busy_neighbour.setattr(model, "forward", spy)
    ctx = Context(model, n_seq_max=2)
    ctx.decode(Batch(list(range(40)), logits=[True] * 40))  # a prompt: 40 tokens of one sequence
    busy_logits = ctx.logits.clone()
    ctx.decode(Batch([3, 4], seq_ids=[[0], [1]], logits=[True, True]))  # a decode step
    cores = threads.all_cores()
    assert seen == [2 * cores, cores] and torch.get_num_threads() == cores
    quiet = Context(model, n_seq_max=1)
    busy_neighbour.setenv("RSMEM_BUSY_THREADS", "0")
    quiet.decode(Batch(list(range(40)), logits=[True] * 40))
    torch.testing.assert_close(busy_logits, quiet.logits, rtol=1e-6, atol=1e-6)
