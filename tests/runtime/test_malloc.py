"""``import rsmem`` fixes glibc's malloc thresholds, so repeated steps reuse freed heap instead of
faulting fresh pages in; the user's own tuning and ``RSMEM_MALLOC=0`` leave malloc as it is."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# Four 3 MiB blocks written and freed, 20 times over, counting minor page faults. With glibc's defaults the
# first free raises the mmap threshold to 3 MiB and the trim threshold to twice that, so the 12 MiB freed
# at the heap's top goes back to the system every round and the next round faults every page in again.
# what both scripts run after: rsmem imported (its malloc policy applied) and libc's malloc and free
LIBC = r"""
import ctypes, json, resource, sys
import rsmem, rsmem.malloc
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
"""

ROUNDS = r"""
SIZE = 3 << 20
def round_():
    blocks = [libc.malloc(SIZE) for _ in range(4)]
    for b in blocks:
        ctypes.memset(b, 1, SIZE)
    for b in blocks:
        libc.free(b)
round_(); round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    round_()
faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20
print(json.dumps({"policy": rsmem.malloc.policy(), "faults": faults, "pages": 4 * SIZE // 4096}))
"""


def rounds(**env: str) -> dict[str, object]:
    clean = {
        k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "GLIBC_TUNABLES", "RSMEM_MALLOC"))
    }
    out = subprocess.run(
        [sys.executable, "-c", LIBC + ROUNDS],
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return dict(json.loads(out.stdout))


pytestmark = [
    pytest.mark.subprocess,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc: Linux only"),
]


def test_freed_blocks_are_reused_without_page_faults():
    kept = rounds()
    assert kept["policy"] == "kept"
    assert kept["faults"] < 64, kept  # a round's 3,072 pages stay with the process


def test_rsmem_malloc_0_leaves_glibcs_defaults_which_fault_every_round():
    off = rounds(RSMEM_MALLOC="0")
    assert off["policy"] == "off"
    assert float(off["faults"]) > 0.5 * float(off["pages"]), off  # what the policy is there to avoid


@pytest.mark.parametrize("variable", ["MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"])
def test_the_users_own_malloc_tuning_is_left_alone(variable: str):
    value = "glibc.malloc.check=0" if variable == "GLIBC_TUNABLES" else "1048576"
    assert rounds(**{variable: value})["policy"] == "user"


# Twenty 8 MiB blocks from the heap (under the kept mmap threshold) written, one more kept at the heap's top,
# the twenty freed: they stay resident until release_freed hands their pages back.
RELEASE = r"""
SIZE = 8 << 20
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
blocks = [libc.malloc(SIZE) for _ in range(20)]
top = libc.malloc(SIZE)
for b in (*blocks, top):
    ctypes.memset(b, 1, SIZE)
for b in blocks:
    libc.free(b)
freed = resident()
released = rsmem.malloc.release_freed()
print(json.dumps({"released": released, "dropped": freed - resident(), "freed": 20 * SIZE}))
"""


def test_release_freed_hands_freed_heap_pages_back():
    out = subprocess.run(
        [sys.executable, "-c", LIBC + RELEASE], capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(out.stdout)
    assert got["released"] is True
    assert got["dropped"] > 0.9 * got["freed"], got  # kept resident by the policy until then
