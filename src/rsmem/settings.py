"""The one place rsmem reads its environment. Each variable is read when it is needed (not at import),
so a process or a test may change it between uses.

========================= ======== ==================================================================
variable                  default  effect
========================= ======== ==================================================================
``RSMEM_COMPILE``         auto     compiled decode steps: ``auto``, ``1`` or ``0`` (a model's own
                                   ``compile=`` setting wins; see ``rsmem.models.compiled``)
``RSMEM_ONEDNN``          1        ``0``: no oneDNN-packed copies of the matrices (saves their memory)
``RSMEM_HUGEPAGES``       1        ``0``: weights and states not placed on transparent huge pages
``CXX``                            the C++ compiler inductor uses, tried before g++, c++, clang++
========================= ======== ==================================================================
"""

from __future__ import annotations

import os


def compile_setting() -> str:
    return os.environ.get("RSMEM_COMPILE", "auto")


def onednn_enabled() -> bool:
    return os.environ.get("RSMEM_ONEDNN", "1") != "0"


def hugepages_enabled() -> bool:
    return os.environ.get("RSMEM_HUGEPAGES") != "0"


def cxx_candidates() -> list[str]:
    return [os.environ.get("CXX", ""), "g++", "c++", "clang++"]
