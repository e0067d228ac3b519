"""Building and loading the C++ kernels (``csrc/``) at first use, with a checked fallback.

:func:`native_ops` builds :data:`SOURCES` (quantized products, Mamba-2's scan, few-row products, the prompt
convolution and gated norm) with
``torch.utils.cpp_extension.load`` (ninja, ``-O3 -march=native``: AVX-512 code where the CPU has it, else a
portable path) into the folder that :func:`rsmem.settings.kernels_setting` names, and loads it as torch ops
(``torch.ops.rsmem_native``: no Python module, so no pybind; with ATen's and torch/library.h's headers instead
of torch/extension.h the headers compile in a fraction of the time). The build is cached there, keyed by
the sources, flags, torch version and the CPU's flags; a later process only loads it. When kernels are
disabled (``RSMEM_KERNELS=0``) or building or loading fails (no compiler, ninja missing, a compile error), it
returns None once with a warning, and the callers use the torch reference twin instead (same results within
the tolerances their tests state).
"""

from __future__ import annotations

import fcntl
import hashlib
import platform
import shutil
import sys
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from rsmem import settings

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = (
    "qmatmul.cpp",
    "ssd_scan.cpp",
    "rows_f32.cpp",
    "conv1d.cpp",
    "gated_norm.cpp",
    "pool.cpp",
    "mamba2_step.cpp",
    "mamba_step.cpp",
    "hybrid_step.cpp",
    "rwkv7_step.cpp",
    "rwkv6_step.cpp",
    "wkv_scan.cpp",
    "sampler.cpp",
)
HEADERS = (
    "blocks.h",
    "bf16_tiles.h",
    "float_routes.h",
    "half_routes.h",
    "int8.h",
    "int8_gemm.h",
    "int8_small.h",
    "mamba2_mixer.h",
    "pool.h",
    "rows_kernel.h",
    "step_common.h",
    "vec_math.h",
    "wkv_token.h",
)
CFLAGS = ("-O3", "-march=native", "-std=c++17", "-fopenmp")

_lock = threading.Lock()
_state: dict[str, Any] = {}


def _cpu_identity() -> str:
    """What -march=native compiles for: the CPU's flags (Linux), else the machine and torch's capability.
    A cache folder shared by machines with different CPUs then keeps one build per CPU kind instead of
    loading code with instructions this CPU lacks."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def _build_name(flags: tuple[str, ...]) -> str:
    """The extension's name: a hash of the sources, their folder, flags, torch version and CPU, so that a
    changed kernel, torch or CPU rebuilds instead of loading a stale or unsuitable library. The folder keeps
    two checkouts of the same sources apart: torch's build writes the sources' paths into its ninja file, so
    with one shared build each would relink the library the other loads (a process that loads the relinked
    file a second time registers its ops twice and aborts)."""
    h = hashlib.sha256(torch.__version__.encode())
    h.update(_cpu_identity().encode())
    h.update(str(CSRC.resolve()).encode())
    for name in (*SOURCES, *HEADERS):
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(flags).encode())
    return f"rsmem_kernels_{h.hexdigest()[:12]}"


def _find_ninja() -> None:
    """torch runs ``ninja`` from PATH; pip installs it beside the interpreter, off PATH in a venv used
    without activating it."""
    beside = Path(sys.executable).parent
    if shutil.which("ninja") is None and (beside / "ninja").exists():
        settings.put_on_path(beside)


def build_variant(namespace: str, cflags: tuple[str, ...], folder: Path) -> Any:
    """Build (or load the cached build of) the kernels with ``cflags`` as the torch ops
    ``torch.ops.<namespace>``. :func:`native_ops` builds ``rsmem_native`` with :data:`CFLAGS`; the tests
    also build a portable variant (no AVX-512) to check the fallback code on this machine."""
    from torch.utils import cpp_extension

    loaded = getattr(torch.ops, namespace)
    if hasattr(loaded, "isa"):  # already in this process: loading a second library would register its ops
        return loaded  # twice and abort (torch renames a build whose folder or flags changed, `name_v1`)
    _find_ninja()
    flags = (*cflags, f"-DRSMEM_OPS_NS={namespace}")
    name = _build_name(flags)
    build_dir = folder / name
    build_dir.mkdir(parents=True, exist_ok=True)
    with _build_lock(build_dir):
        if not (build_dir / f"{name}.so").exists():  # slow, once per machine: say so, not a pause
            sys.stderr.write(f"[rsmem: building its C++ kernels for this CPU, once, into {build_dir}]\n")
        cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=list(flags),
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CSRC)],
            build_directory=str(build_dir),
            is_python_module=False,
            verbose=False,
        )
    return getattr(torch.ops, namespace)


@contextmanager
def _build_lock(build_dir: Path) -> Iterator[None]:
    """Hold rsmem's own lock on ``build_dir`` while torch builds or loads there.

    torch's build marks itself with a ``lock`` file and waits, without end, while one exists; a build killed
    midway (a timed-out test, Ctrl-C) leaves it behind, and every later process then hangs. rsmem's lock is
    an ``flock`` on another file, which the kernel releases when its holder dies: whoever holds it is the
    only rsmem build in that folder, so a torch ``lock`` found then was left by a build that did not finish,
    and goes (with a line saying so). Two processes starting at once still build once: the second waits
    here, then loads what the first built."""
    with open(build_dir / "rsmem-build.flock", "a+b") as held:
        try:
            fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        except OSError:  # a file system without flock: build as torch alone would, leaving its lock be
            yield
            return
        try:
            left = build_dir / "lock"
            if left.exists():
                left.unlink()
                sys.stderr.write(f"[rsmem: removed a kernel build lock left by a killed build, {left}]\n")
            yield
        finally:
            fcntl.flock(held.fileno(), fcntl.LOCK_UN)


def _build() -> Any:
    enabled, folder = settings.kernels_setting()
    if not enabled:
        return None
    return build_variant("rsmem_native", CFLAGS, folder)


def native_ops() -> Any:
    """``torch.ops.rsmem_native`` (qmatmul, dequantize, ssd_scan_, isa) once built and loaded, else None
    (kernels disabled, or the build failed: warned once). The outcome is kept for the process."""
    if "ops" not in _state:
        with _lock:
            if "ops" not in _state:
                spin = settings.spin_setting()  # a bad value is the caller's error, not a failed build
                try:
                    ops = _build()
                    if ops is not None:
                        ops.set_public(True)  # rsmem::qmatmul on CPU now calls the C++ kernel directly
                        if spin is not None:
                            ops.set_pool(spin)  # the product workers' wait (csrc/pool.h)
                    _state["ops"] = ops
                except Exception as exc:  # no compiler, no ninja, a compile error: the reference twin
                    _state["ops"] = None
                    _state["error"] = exc
                    warnings.warn(
                        f"rsmem: building the quantized-matrix kernels failed, using the torch reference "
                        f"instead (slower): {exc}",
                        RuntimeWarning,
                        stacklevel=3,
                    )
    return _state["ops"]


# Prompts from this many tokens take the C++ kernels, building them on first use; a shorter one (a chat's
# first words, ``make run``) takes them only when they are already loaded (``rsmem serve`` loads them at
# start), and never waits for their first build.
PROMPT_MIN_TOKENS = 64


def prompt_ops(n_tokens: int, *tensors: torch.Tensor) -> Any:
    """The kernels for one of a prompt's ops (Mamba-2's scan, the convolution, the norms) over ``n_tokens``
    tokens of these tensors, else None: two tokens or more, float32 CPU tensors, not inside a graph being
    compiled or one that records gradients; built for :data:`PROMPT_MIN_TOKENS` tokens up, otherwise only
    when already loaded. The callers check their kernel's layouts."""
    if n_tokens < 2 or torch.compiler.is_compiling():
        return None
    if not all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors):
        return None
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return None
    return native_ops() if n_tokens >= PROMPT_MIN_TOKENS else loaded_native_ops()


def loaded_native_ops() -> Any:
    """The kernels when :func:`native_ops` has already built or loaded them in this process, else None:
    never builds (for work too small to wait for the first build)."""
    return _state.get("ops")


def reset() -> None:
    """Forget the outcome of :func:`native_ops`, so that the next call decides again (reads
    ``RSMEM_KERNELS`` again, builds or loads again, warns again on failure). For tests."""
    with _lock:
        ops = _state.pop("ops", None)
        if ops is not None:
            ops.set_public(False)
        _state.clear()


def build_error() -> BaseException | None:
    """Why :func:`native_ops` returned None after a failed build (None when it did not fail)."""
    return _state.get("error")
