"""Freed memory kept for the next step: glibc's malloc tuned so that repeated steps do not fault pages in.

A model step allocates the same few activation tensors again and again (a 512-token prompt chunk of the
embedded model: tensors of 1-3 MiB). glibc's malloc serves blocks above its mmap threshold with a fresh
``mmap`` and gives them back on ``free``; its threshold rises to the largest block freed, and the top of
the heap is handed back to the system whenever more than twice that lies free there. Either way the next
step's tensors land on pages the kernel must fault in and zero again, thousands of minor page faults a
chunk, and a step that faults its tensors in runs slower than one that reuses the pages it freed.

``import rsmem`` therefore fixes glibc's thresholds (``mallopt``): blocks up to :data:`MMAP_THRESHOLD`
come from the heap, and up to :data:`TRIM_THRESHOLD` of free heap top stays with the process. The cost is
that memory: a process may keep up to ~128 MiB it freed, instead of returning it at once. It is left
alone when the user tuned malloc (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``, ``MALLOC_TOP_PAD_``
or ``GLIBC_TUNABLES`` set), with ``RSMEM_MALLOC=0``, or off glibc (musl, macOS: ``mallopt`` absent).
Another allocator preloaded (jemalloc, tcmalloc) keeps its own policy (the call is then harmless).
"""

from __future__ import annotations

import ctypes
from typing import Literal

from rsmem import settings

MallocPolicy = Literal["kept", "user", "off", "unavailable"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed mmap threshold on 64-bit (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 128 << 20

_policy: MallocPolicy | None = None


def keep_freed_memory() -> MallocPolicy:
    """Fix glibc's trim and mmap thresholds for this process (once; later calls say what the first did):
    ``kept``, ``user`` (the environment tunes malloc), ``off`` (``RSMEM_MALLOC=0``) or ``unavailable``
    (no glibc ``mallopt``, or it refused)."""
    global _policy
    if _policy is None:
        _policy = _apply()
    return _policy


def policy() -> MallocPolicy | None:
    """What :func:`keep_freed_memory` did in this process (None before it ran)."""
    return _policy


def _apply() -> MallocPolicy:
    choice = settings.malloc_setting()
    if choice != "auto":
        return choice
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the process's own symbols: libc's, where it is glibc
    except (OSError, AttributeError):
        return "unavailable"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either fixes both (glibc stops moving them), and the trim one
    # alone would leave blocks above the static 128 KiB mmap threshold on mmap
    if mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1 or mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) != 1:
        return "unavailable"
    return "kept"


def release_freed() -> bool:
    """Hand the process's freed heap memory back to the system now (glibc's ``malloc_trim(0)``, which also
    releases whole free pages inside the heap, not only at its top). For after a model's load: the models
    copy the loader's matrices onto huge pages (:mod:`rsmem.hugepages`) and drop them, and with the kept
    thresholds those blocks (up to :data:`MMAP_THRESHOLD` each) stay resident, a large share of a small
    model's weights.
    False where there is no glibc ``malloc_trim``."""
    try:
        malloc_trim = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    malloc_trim.argtypes, malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    malloc_trim(0)
    return True
