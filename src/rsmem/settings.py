"""The one place rsmem reads its environment. Each variable is read when it is needed (not at import),
so a process or a test may change it between uses.

========================= ======== ==================================================================
variable                  default  effect
========================= ======== ==================================================================
``RSMEM_COMPILE``         auto     compiled decode steps: ``auto``, ``1`` or ``0`` (a model's own
                                   ``compile=`` setting wins; see ``rsmem.models.step.compiled``)
``RSMEM_ONEDNN``          1        ``0``: no oneDNN-packed copies of the matrices (saves their memory)
``RSMEM_PACKED_TWINS``    1        ``0``: oneDNN products on the plain matrices, without their packed
                                   copies (each weight held once; see ``rsmem.models.step.packed``)
``RSMEM_HUGEPAGES``       1        ``0``: weights and states not placed on transparent huge pages
``CXX``                            the C++ compiler inductor uses, tried before g++, c++, clang++
``RSMEM_THREADS``         auto     torch's intra-op threads when a model loads: ``auto`` (by the model's
                                   size, see ``rsmem.threads``) or a number; ``threads=`` / ``-t`` win
``RSMEM_OMP_PASSIVE``     1        ``0``: leave OpenMP's wait policy alone; otherwise ``import rsmem``
                                   sets ``OMP_WAIT_POLICY=PASSIVE`` when neither it nor
                                   ``GOMP_SPINCOUNT`` is set (before torch loads: see ``rsmem.threads``)
``RSMEM_KERNELS``         1        ``0``: no C++ kernels for quantized matrices (``rsmem.kernels`` uses
                                   its torch reference instead)
``RSMEM_MALLOC``          1        ``0``: leave glibc's malloc thresholds alone (``rsmem.malloc``); they
                                   are also left when ``MALLOC_TRIM_THRESHOLD_``,
                                   ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``GLIBC_TUNABLES``
                                   is set
``RSMEM_NATIVE_STEP``     1        ``0``: Mamba-2's one-sequence decode through its compiled step instead
                                   of the C++ step (``rsmem.models.step.native``)
``RSMEM_KERNELS_DIR``              where the C++ kernels are built and cached (default
                                   ``$XDG_CACHE_HOME/rsmem/kernels``, else ``~/.cache/rsmem/kernels``)
========================= ======== ==================================================================

Besides reading, :func:`prepare_openmp_environment` writes one variable: ``OMP_WAIT_POLICY``, which
libgomp reads once, when torch is first imported; :func:`put_on_path` adds the interpreter's folder to
``PATH`` when the C++ kernels are built and ``ninja`` is not found (``rsmem.kernels.build``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Literal

WaitPolicy = Literal["passive", "user", "off", "too late"]


def compile_setting(default: str = "auto") -> str:
    """``RSMEM_COMPILE``, else ``default`` (the CLI's commands choose theirs: ``serve`` compiles)."""
    return os.environ.get("RSMEM_COMPILE", default)


def onednn_enabled() -> bool:
    return os.environ.get("RSMEM_ONEDNN", "1") != "0"


def packed_twins_enabled() -> bool:
    return os.environ.get("RSMEM_PACKED_TWINS", "1").strip() != "0"


def native_step_enabled() -> bool:
    return os.environ.get("RSMEM_NATIVE_STEP", "1").strip() != "0"


def hugepages_enabled() -> bool:
    return os.environ.get("RSMEM_HUGEPAGES") != "0"


def kernels_setting() -> tuple[bool, Path]:
    """Whether rsmem's C++ kernels for quantized matrices are enabled (``RSMEM_KERNELS`` not ``0``) and the
    folder they are built and cached in (``RSMEM_KERNELS_DIR``, else the user's cache folder)."""
    enabled = os.environ.get("RSMEM_KERNELS", "1").strip() != "0"
    folder = os.environ.get("RSMEM_KERNELS_DIR", "").strip()
    if folder:
        return enabled, Path(folder)
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(os.path.expanduser("~"), ".cache")
    return enabled, Path(cache) / "rsmem" / "kernels"


def put_on_path(folder: Path) -> bool:
    """Put ``folder`` first on ``PATH`` unless it is there already (pip installs ninja next to the
    interpreter, which is not on ``PATH`` when a venv is used without activating it); whether it was added."""
    current = os.environ.get("PATH", "")
    if str(folder) in current.split(os.pathsep):
        return False
    os.environ["PATH"] = f"{folder}{os.pathsep}{current}" if current else str(folder)
    return True


def cxx_candidates() -> list[str]:
    return [os.environ.get("CXX", ""), "g++", "c++", "clang++"]


def threads_setting() -> int | None:
    """``RSMEM_THREADS`` as a thread count, or None for ``auto`` (unset, empty or ``auto``)."""
    raw = os.environ.get("RSMEM_THREADS", "").strip().lower()
    if raw in ("", "auto"):
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"RSMEM_THREADS must be 'auto' or a number >= 1, got {raw!r}") from None
    if n < 1:
        raise ValueError(f"RSMEM_THREADS must be 'auto' or a number >= 1, got {n}")
    return n


def busy_threads_enabled() -> bool:
    """``RSMEM_BUSY_THREADS``: ``0`` keeps prompt work on the usual thread count beside busy processes
    (:func:`rsmem.threads.prompt_threads`)."""
    return os.environ.get("RSMEM_BUSY_THREADS", "1").strip() != "0"


def spin_setting() -> int | None:
    """``RSMEM_SPIN_US``: microseconds rsmem's product workers spin (yielding the core to any other thread)
    for the next product before they sleep; 0 sleeps at once, a negative value hands the products to torch's
    OpenMP threads. None when unset: the kernels' default (``kernels/csrc/pool.cpp``)."""
    raw = os.environ.get("RSMEM_SPIN_US", "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"RSMEM_SPIN_US must be a whole number of microseconds, got {raw!r}") from None


def openmp_waits_passively() -> bool:
    """Whether the environment makes OpenMP's idle threads sleep at once (read as torch loads)."""
    policy = os.environ.get("OMP_WAIT_POLICY", "").strip().upper()
    return policy == "PASSIVE" or os.environ.get("GOMP_SPINCOUNT", "").strip() == "0"


def malloc_setting() -> Literal["auto", "user", "off"]:
    """Whether ``import rsmem`` may tune glibc's malloc: ``off`` (``RSMEM_MALLOC=0``), ``user`` (the
    environment tunes it already: glibc read that at start), else ``auto``."""
    if os.environ.get("RSMEM_MALLOC", "").strip() == "0":
        return "off"
    tuned = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")
    if any(name in os.environ for name in tuned):
        return "user"
    return "auto"


def prepare_openmp_environment() -> WaitPolicy:
    """Make OpenMP's idle threads sleep instead of spinning (``OMP_WAIT_POLICY=PASSIVE``) unless the user
    chose (``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` set: ``"user"``) or ``RSMEM_OMP_PASSIVE=0`` (``"off"``).
    libgomp reads the variable once, when torch loads, so this runs before ``import torch``; when torch is
    already imported it changes nothing and says ``"too late"``."""
    if os.environ.get("RSMEM_OMP_PASSIVE") == "0":
        return "off"
    if "OMP_WAIT_POLICY" in os.environ or "GOMP_SPINCOUNT" in os.environ:
        return "user"
    if "torch" in sys.modules:
        return "too late"
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    return "passive"


def restore_openmp_environment(policy: WaitPolicy) -> None:
    """Take back what :func:`prepare_openmp_environment` put into ``os.environ`` once torch (and with it
    libgomp, which read it) has loaded: the policy is rsmem's, for its own process; the programs it or its
    user start keep theirs (a llama.cpp started from a process that imported rsmem would inherit sleeping
    threads and run its quiet steps slower)."""
    if policy == "passive" and "torch" in sys.modules:
        os.environ.pop("OMP_WAIT_POLICY", None)
