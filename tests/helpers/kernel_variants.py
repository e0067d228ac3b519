"""The C++ kernels built for another CPU level, as a second set of ops (for the AVX2 and portable code)."""

from __future__ import annotations

from typing import Any

from rsmem import settings
from rsmem.kernels import build

NAMESPACES = {"x86-64-v2": "rsmem_native_portable", "x86-64-v3": "rsmem_native_avx2"}


def ops_for_march(march: str) -> Any:
    """``torch.ops`` of the kernels built with ``-march=march`` (x86-64-v2: no AVX, the scalar loops;
    x86-64-v3: AVX2, F16C, FMA) into the kernels' folder, under their own namespace (built once)."""
    _, folder = settings.kernels_setting()
    flags = (*(f for f in build.CFLAGS if not f.startswith("-march")), f"-march={march}")
    return build.build_variant(NAMESPACES[march], flags, folder)
