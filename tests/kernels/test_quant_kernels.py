"""rsmem.kernels: dequantize_rows against gguf, qmatmul (every route the C++ side has) against its
reference twin, the torch op under torch.compile, the fallback without kernels, and bad inputs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from helpers.kernel_variants import ops_for_march
from rsmem import settings
from rsmem.kernels import (
    KERNEL_TYPES,
    build,
    dequantize_rows,
    kernels_active,
    qmatmul,
    qmatmul_ref,
    row_bytes,
)
from rsmem.kernels.formats import block_shape

pytestmark = pytest.mark.compiled

Q = gguf.GGMLQuantizationType
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}
# float32 activations: only the summation order differs from the reference, an error bounded by a few
# float32 epsilons (1.2e-7) times the sum of the terms' magnitudes, sum_i |x_i w_i| (K <= 768 here)
F32_RTOL = 1e-6


def random_blocks(qtype: Q, n: int, k: int, seed: int = 0, any_scales: bool = False) -> torch.Tensor:
    """Random block bytes; the f16 scales small and finite unless ``any_scales``."""
    rng = np.random.default_rng(seed)
    bs, ts = block_shape(qtype)
    b = rng.integers(0, 256, (n, k // bs, ts), dtype=np.uint8)
    if not any_scales:
        d = (rng.random((n, k // bs)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // bs, 2)
        for off in SCALE_OFFSETS[qtype]:
            b[:, :, off : off + 2] = d
    return torch.from_numpy(b.reshape(n, -1).copy())


def q8_activations(x: torch.Tensor) -> torch.Tensor:
    """``x`` after llama.cpp's activation quantization for Q8_0/Q4_0 weights (quantize_row_q8_0: blocks of
    32, ``d = amax / 127``, ``round(x / d)``); for the K-quants llama.cpp uses blocks of 256 (coarser)."""
    xb = x.reshape(x.shape[0], -1, 32)
    d = xb.abs().amax(-1, keepdim=True) / 127
    return (torch.round(xb / torch.where(d == 0, 1, d)) * d).reshape(x.shape)


def assert_bf16_close(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: Q, k: int) -> None:
    """The bf16 route (activations and dequantized weights rounded to bfloat16, float32 sums): its largest
    error is at most that of llama.cpp's 8-bit activations against the exact product (measured ~2.5x
    smaller on these inputs), and under 1e-2 of the largest output."""
    w = dequantize_rows(blocks, qtype, k).double()
    exact = x.double() @ w.T
    ours = (y.double() - exact).abs().max().item()
    llama = (q8_activations(x).double() @ w.T - exact).abs().max().item()
    assert ours <= llama, f"bf16 route error {ours:.3g} > 8-bit activations' {llama:.3g}"
    assert ours <= 1e-2 * exact.abs().max().item()


def q8k_activations(x: torch.Tensor, block: int = 256) -> torch.Tensor:
    """``x`` after llama.cpp's Q8_K quantization (blocks of 256: ``d = 1 / (127 / amax)``, ``round(x * 127 /
    amax)`` in float32, half to even), as float64: what the int8 routes multiply K-quants with; ``block=32``:
    the same per 32 values (as llama.cpp's Q8_0), for Q8_0 and Q4_0 weights."""
    xb = x.reshape(x.shape[0], -1, block)
    amax = xb.abs().amax(-1, keepdim=True)
    # true divisions (a Python number divided by a tensor is a reciprocal times it in torch: 1 ulp off)
    iscale = torch.where(amax == 0, 0.0, torch.full_like(amax, 127.0) / amax.clamp_min(1e-38))
    d = torch.where(amax == 0, 0.0, torch.ones_like(amax) / iscale.clamp_min(1e-38))
    return (torch.round(xb * iscale).double() * d.double()).reshape(x.shape)


# the int8 route against its twin (Q8_K activations, float64 product): the integer sums are exact, only the
# float32 block scales and sums round (a few float32 epsilons of sum_i |x_i w_i|); a wrong sub-block, scale
# or nibble order is off by ~1e-1 of it
INT8_RTOL = 1e-6


INT8_TYPES = (Q.Q4_K, Q.Q5_K, Q.Q6_K)
# Q8_0 and Q4_0 take the int8 routes (activations per 32 values) where k % 256 == 0: route 3 up to this
# many rows, route 4 (int8 panels) beyond
SMALL_REGISTERS_MAX_M = 8


def uses_int8(qtype: Q, m: int, k: int) -> bool:
    """Whether rsmem::qmatmul takes an int8 route (3 or 4) for ``m`` rows of ``qtype`` here."""
    ops = build.native_ops()
    if ops is None or "vnni" not in ops.isa():
        return False
    return qtype in INT8_TYPES or k % 256 == 0


def assert_int8_close(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: Q, k: int) -> None:
    """``y`` is the product of the Q8_K-quantized activations with the dequantized weights, to
    INT8_RTOL x sum_i |x_i w_i| each output."""
    w = dequantize_rows(blocks, qtype, k).double()
    want = q8k_activations(x, 256 if qtype in INT8_TYPES else 32) @ w.T
    magnitude = (x.abs().double() @ w.abs().T).clamp_min(1e-30)
    worst = ((y.double() - want).abs() / magnitude).max().item() if want.numel() else 0.0
    assert worst <= INT8_RTOL, f"int8 route error {worst:.3g} of sum |x w| > {INT8_RTOL}"


def assert_default_close(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: Q, k: int) -> None:
    """``y`` from the route rsmem::qmatmul chooses for ``x``'s row count, within that route's bound."""
    ops = build.native_ops()
    if uses_int8(qtype, x.shape[0], k):
        assert_int8_close(y, x, blocks, qtype, k)
    elif x.shape[0] >= 9 and ops is not None and "bf16" in ops.isa():
        assert_bf16_close(y, x, blocks, qtype, k)
    else:
        assert_f32_close(y, x, blocks, qtype, k)


def assert_f32_close(y: torch.Tensor, x: torch.Tensor, blocks: torch.Tensor, qtype: Q, k: int) -> None:
    """``y`` is within F32_RTOL x sum_i |x_i w_i| of the reference, each output."""
    ref = qmatmul_ref(x, blocks, qtype, k)
    assert y.shape == ref.shape
    magnitude = x.abs() @ dequantize_rows(blocks, qtype, k).abs().T
    err = (y - ref).abs()
    worst = (err / magnitude.clamp_min(1e-30)).max().item() if ref.numel() else 0.0
    assert worst <= F32_RTOL, f"error {worst:.3g} of sum |x w| > {F32_RTOL}"


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_dequantize_rows_equals_gguf(qtype: Q) -> None:
    blocks = random_blocks(qtype, 5, 512, any_scales=True)
    with np.errstate(all="ignore"):
        ref = gguf.quants.dequantize(blocks.numpy(), qtype)
    ours = dequantize_rows(blocks, qtype, 512).numpy()
    assert ours.shape == ref.shape == (5, 512)
    np.testing.assert_array_equal(ours, ref)  # NaN where gguf has NaN (random f16 scales)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_native_dequantize_equals_gguf(qtype: Q) -> None:
    ops = build.native_ops()
    if ops is None:
        pytest.skip(f"kernels not built here: {build.build_error()}")
    blocks = random_blocks(qtype, 7, 768, seed=1)
    ref = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype))
    assert torch.equal(ops.dequantize(blocks, int(qtype), 768), ref)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("m", [1, 3, 5, 8, 9, 16, 17, 64, 512])
def test_qmatmul_matches_reference(qtype: Q, m: int) -> None:
    """With AVX512-VNNI, K-quants and Q8_0 / Q4_0 (k a multiple of 256): int8 activations (their twin);
    without, M <= 8: float32 activations (the reference up to summation order), M >= 9: the bf16 route
    where the CPU has AVX512-BF16, else float32 tiles."""
    n, k = 37, 512  # N odd: a last group of fewer than four weight rows
    blocks = random_blocks(qtype, n, k, seed=m)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    y = qmatmul(x, blocks, qtype, k)
    assert y.shape == (m, n) and y.dtype == torch.float32
    assert_default_close(y, x, blocks, qtype, k)


@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("route", [0, 1, 2])
def test_every_route_matches_reference(qtype: Q, route: int) -> None:
    """Each C++ route (0 registers, 1 float32 tiles, 2 bf16 tiles) at row counts it is not chosen for by
    default, single weight rows and partial tiles."""
    ops = build.native_ops()
    if ops is None:
        pytest.skip(f"kernels not built here: {build.build_error()}")
    if route == 2 and "bf16" not in ops.isa():
        pytest.skip("no AVX512-BF16 here: route 2 is route 1")
    k = 768
    for n, m in ((1, 1), (6, 5), (131, 20), (64, 2), (9, 33), (70, 16)):
        blocks = random_blocks(qtype, n, k, seed=n)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(n))
        y = ops.qmatmul(x, blocks, int(qtype), k, route)
        if route == 2:
            assert_bf16_close(y, x, blocks, qtype, k)
        else:
            assert_f32_close(y, x, blocks, qtype, k)


def test_empty_and_strided_inputs() -> None:
    blocks = random_blocks(Q.Q8_0, 9, 64)
    assert qmatmul(torch.zeros(0, 64), blocks, Q.Q8_0, 64).shape == (0, 9)
    x = torch.randn(64, 3).T  # not contiguous
    assert_f32_close(qmatmul(x, blocks, Q.Q8_0, 64), x.contiguous(), blocks, Q.Q8_0, 64)
    blocks = random_blocks(Q.Q6_K, 9, 256)
    x = torch.randn(256, 2).T
    assert_default_close(qmatmul(x, blocks, Q.Q6_K, 256), x.contiguous(), blocks, Q.Q6_K, 256)


def test_reference_works_in_row_tiles(monkeypatch: pytest.MonkeyPatch) -> None:
    from rsmem.kernels import quant

    blocks = random_blocks(Q.Q4_K, 10, 256)
    x = torch.randn(2, 256)
    w = dequantize_rows(blocks, Q.Q4_K, 256)
    monkeypatch.setattr(quant, "REF_TILE_VALUES", 3 * 256)  # tiles of 3 rows: 3 + 3 + 3 + 1
    err = (qmatmul_ref(x, blocks, Q.Q4_K, 256) - x @ w.T).abs() / (x.abs() @ w.abs().T)
    assert err.max().item() <= F32_RTOL


def test_op_under_torch_compile() -> None:
    k = 512
    mats = [(t, random_blocks(t, 19, k, seed=int(t))) for t in KERNEL_TYPES]

    def step(x: torch.Tensor, *blocks: torch.Tensor) -> torch.Tensor:
        return torch.cat([qmatmul(x, b, t, k) for (t, _), b in zip(mats, blocks)], dim=1) * 2.0 + 1.0

    compiled = torch.compile(step, fullgraph=True, dynamic=False)
    x = torch.randn(1, k)
    b = [m for _, m in mats]
    y = compiled(x, *b)
    for i, (t, m) in enumerate(mats):
        assert_default_close((y[:, 19 * i : 19 * (i + 1)] - 1.0) / 2.0, x, m, t, k)
    assert_default_close(torch.ops.rsmem.qmatmul(x, b[0], int(Q.Q8_0), k), x, b[0], Q.Q8_0, k)


def test_op_under_torch_compile_with_a_dynamic_batch() -> None:
    """As the models' batched steps compile it: the row count marked dynamic, one graph for every M."""
    k = 256
    blocks = random_blocks(Q.Q4_K, 21, k, seed=5)
    compiled = torch.compile(lambda x, b: qmatmul(x, b, Q.Q4_K, k) * 2.0, fullgraph=True)
    for m in (3, 5, 2):
        x = torch.randn(m, k)
        torch._dynamo.mark_dynamic(x, 0)
        with torch.inference_mode():
            y = compiled(x, blocks)
        assert y.shape == (m, 21)
        assert_default_close(y / 2.0, x, blocks, Q.Q4_K, k)


@pytest.fixture
def fresh_build(monkeypatch: pytest.MonkeyPatch):
    build.reset()
    yield monkeypatch
    monkeypatch.undo()
    build.reset()


def test_disabled_kernels_give_reference_results(fresh_build: pytest.MonkeyPatch) -> None:
    fresh_build.setenv("RSMEM_KERNELS", "0")
    assert not kernels_active()
    for qtype in KERNEL_TYPES:
        blocks = random_blocks(qtype, 11, 256)
        x = torch.randn(3, 256)
        assert torch.equal(qmatmul(x, blocks, qtype, 256), qmatmul_ref(x, blocks, qtype, 256))


def test_failed_build_warns_once_and_falls_back(fresh_build: pytest.MonkeyPatch) -> None:
    def broken() -> None:
        raise RuntimeError("no compiler here")

    fresh_build.setattr(build, "_build", broken)
    blocks = random_blocks(Q.Q6_K, 4, 256)
    x = torch.randn(2, 256)
    with pytest.warns(RuntimeWarning, match="no compiler here"):
        y = qmatmul(x, blocks, Q.Q6_K, 256)
    assert torch.equal(y, qmatmul_ref(x, blocks, Q.Q6_K, 256))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        qmatmul(x, blocks, Q.Q6_K, 256)  # no second warning
    assert isinstance(build.build_error(), RuntimeError)


def test_kernels_are_built_here() -> None:
    """This machine has g++ and ninja: the kernels must build (a silent fallback would hide a bug)."""
    assert kernels_active(), build.build_error()


@pytest.mark.parametrize("fn", [qmatmul, qmatmul_ref], ids=["qmatmul", "qmatmul_ref"])
def test_bad_inputs_raise_value_error(fn) -> None:
    blocks = random_blocks(Q.Q8_0, 4, 64)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="row_bytes=68"):
        fn(x, blocks, Q.Q4_0, 64)  # Q4_0 rows of 64 values take 36 bytes
    with pytest.raises(ValueError, match="not a positive multiple of Q8_0's block size 32"):
        fn(torch.randn(2, 48), blocks, Q.Q8_0, 48)
    with pytest.raises(ValueError, match="has no kernel"):
        fn(x, blocks, Q.Q4_1, 64)
    with pytest.raises(ValueError, match="float32"):
        fn(x.double(), blocks, Q.Q8_0, 64)
    with pytest.raises(ValueError, match=r"x must be a float32 \[M, 64\]"):
        fn(torch.randn(2, 32), blocks, Q.Q8_0, 64)
    with pytest.raises(ValueError, match="2-D uint8"):
        fn(x, blocks.view(torch.int8), Q.Q8_0, 64)


def test_bad_inputs_raise_value_error_when_compiling() -> None:
    blocks = random_blocks(Q.Q8_0, 4, 64)
    compiled = torch.compile(lambda x, b: qmatmul(x, b, Q.Q4_K, 256), fullgraph=True)
    with pytest.raises(Exception, match="row_bytes=68"):
        compiled(torch.randn(1, 256), blocks)


def test_row_bytes() -> None:
    assert row_bytes(Q.Q8_0, 768) == 24 * 34
    assert row_bytes(Q.Q4_K, 768) == 3 * 144
    assert row_bytes(Q.Q6_K, 256) == 210
    with pytest.raises(ValueError, match="multiple"):
        row_bytes(Q.Q5_K, 128)


@pytest.mark.slow
def test_portable_build_matches_reference() -> None:
    """The code for CPUs without AVX-512 (blocks.h's scalar decoders), built here with -march=x86-64-v2 as
    a second set of ops: routes 0 and 1 against the reference, and its dequantizer equal to gguf's."""
    if not kernels_active():
        pytest.skip(f"kernels not built here: {build.build_error()}")
    ops = ops_for_march("x86-64-v2")
    assert ops.isa() == "portable"
    for qtype in KERNEL_TYPES:
        blocks = random_blocks(qtype, 13, 512, seed=3)
        ref = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), qtype))
        assert torch.equal(ops.dequantize(blocks, int(qtype), 512), ref)
        for m, route in ((1, 0), (6, 0), (20, 1), (20, -1)):
            x = torch.randn(m, 512)
            assert_f32_close(ops.qmatmul(x, blocks, int(qtype), 512, route), x, blocks, qtype, 512)


def test_loaded_kernels_serve_the_op_directly(fresh_build: pytest.MonkeyPatch) -> None:
    """Once built, the C++ kernel is rsmem::qmatmul's CPU kernel (no Python hop a call); reset removes it."""
    has_cpu_kernel = torch._C._dispatch_has_kernel_for_dispatch_key
    assert kernels_active()
    assert has_cpu_kernel("rsmem::qmatmul", "CPU")
    build.reset()
    assert not has_cpu_kernel("rsmem::qmatmul", "CPU")
    qmatmul(torch.randn(1, 32), random_blocks(Q.Q8_0, 2, 32), Q.Q8_0, 32)  # first use loads them again
    assert has_cpu_kernel("rsmem::qmatmul", "CPU")


def test_ninja_beside_the_interpreter_is_put_on_path(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A venv used without activating it: pip's ninja sits beside the interpreter, off PATH."""
    (tmp_path / "ninja").write_text("")
    monkeypatch.setattr(build.sys, "executable", str(tmp_path / "python"))
    monkeypatch.setattr(build.shutil, "which", lambda name: None)
    monkeypatch.setenv("PATH", "/usr/bin")
    build._find_ninja()
    assert os.environ["PATH"] == f"{tmp_path}{os.pathsep}/usr/bin"
    assert not settings.put_on_path(tmp_path)  # already there: PATH unchanged
    assert os.environ["PATH"] == f"{tmp_path}{os.pathsep}/usr/bin"


def test_two_checkouts_of_the_same_sources_build_apart(tmp_path, monkeypatch) -> None:
    """The same sources in another folder get their own build (a shared one would be relinked under the
    other checkout's processes: torch's ninja file names the sources' paths)."""
    import shutil

    here = build._build_name(build.CFLAGS)
    assert build._build_name(build.CFLAGS) == here  # stable
    copy = tmp_path / "csrc"
    shutil.copytree(build.CSRC, copy)
    monkeypatch.setattr(build, "CSRC", copy)
    assert build._build_name(build.CFLAGS) != here


def test_a_loaded_library_is_never_loaded_again(tmp_path, monkeypatch) -> None:
    """Once the ops are in this process, building again (another folder, after reset) returns them: torch
    would build `name_v1` for a changed folder, and loading it registers the ops a second time (abort)."""
    from torch.utils import cpp_extension

    assert kernels_active(), build.build_error()
    monkeypatch.setattr(cpp_extension, "load", lambda **_: pytest.fail("loaded the library again"))
    assert build.build_variant("rsmem_native", build.CFLAGS, tmp_path) is torch.ops.rsmem_native


def _fake_build(monkeypatch, namespace: str, tmp_path: Path) -> tuple[Path, list[tuple[float, bool]]]:
    """build_variant with torch's build replaced by a recorder: when it ran, whether torch's lock existed."""
    name = build._build_name((*build.CFLAGS, f"-DRSMEM_OPS_NS={namespace}"))
    from torch.utils import cpp_extension

    build_dir = tmp_path / name
    calls: list[tuple[float, bool]] = []
    monkeypatch.setattr(
        cpp_extension, "load", lambda **_: calls.append((time.monotonic(), (build_dir / "lock").exists()))
    )
    return build_dir, calls


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch, capsys):
    """torch's build waits without end while its ``lock`` file exists; one left behind by a killed build
    (nobody holds rsmem's flock) goes before the build, with a line saying so."""
    build_dir, calls = _fake_build(monkeypatch, "rsmem_locktest_a", tmp_path)
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()
    build.build_variant("rsmem_locktest_a", build.CFLAGS, tmp_path)
    assert [seen for _, seen in calls] == [False]
    assert "left by a killed build" in capsys.readouterr().err
    build.build_variant("rsmem_locktest_a", build.CFLAGS, tmp_path)  # no lock at all: nothing to say
    assert "build lock" not in capsys.readouterr().err


@pytest.mark.subprocess
def test_a_build_in_progress_elsewhere_is_waited_for(tmp_path, monkeypatch, capsys):
    """Another process building (it holds rsmem's flock, torch's ``lock`` exists) is not disturbed: this
    one waits until it is done, then loads, and removes nothing."""
    build_dir, calls = _fake_build(monkeypatch, "rsmem_locktest_b", tmp_path)
    build_dir.mkdir(parents=True)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import fcntl, pathlib, sys, time\n"
            "d = pathlib.Path(sys.argv[1])\n"
            "f = open(d / 'rsmem-build.flock', 'a+b'); fcntl.flock(f.fileno(), fcntl.LOCK_EX)\n"
            "(d / 'lock').touch(); print('held', flush=True); time.sleep(1.0); (d / 'lock').unlink()\n",
            str(build_dir),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
    held_at = time.monotonic()
    build.build_variant("rsmem_locktest_b", build.CFLAGS, tmp_path)
    assert holder.wait(timeout=30) == 0
    assert [seen for _, seen in calls] == [False]  # it ran after the holder removed its own lock
    assert calls[0][0] - held_at > 0.5  # and waited for it (the holder held ~1 s)
    assert "build lock" not in capsys.readouterr().err


def test_a_file_system_without_flock_builds_as_before(tmp_path, monkeypatch, capsys):
    """flock refused (some network file systems): the build goes on, and torch's lock is left alone."""
    build_dir, calls = _fake_build(monkeypatch, "rsmem_locktest_c", tmp_path)
    build_dir.mkdir(parents=True)

    def refuse(fd: int, op: int) -> None:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(build.fcntl, "flock", refuse)
    build.build_variant("rsmem_locktest_c", build.CFLAGS, tmp_path)
    assert [seen for _, seen in calls] == [False]
    assert "build lock" not in capsys.readouterr().err
