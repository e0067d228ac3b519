"""Weights and states on transparent huge pages: one-sequence decode streams every matrix (and, for
Mamba-2, 19 MB of state) from memory, and does so faster from 2 MiB pages.

With 4 KiB pages a 500 MB model spans 125k pages: the hardware prefetchers stop at every page boundary and
the TLB misses on each. Linux backs anonymous memory with 2 MiB pages only where asked
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``madvise`` on many machines, including this project's),
and torch's allocator does not ask, so a one-row product streams its matrices slower than it could.

The matrices are copied into one anonymous ``mmap`` (64-byte aligned one after another, so small models
waste nothing) advised ``MADV_HUGEPAGE`` before first touch; the tensors keep the mapping alive. Where the
platform has no ``madvise``, or with ``RSMEM_HUGEPAGES=0`` in the environment, the tensors are returned as
they were.
"""

from __future__ import annotations

import math
import mmap
import weakref
from collections.abc import Callable, Sequence
from typing import TypeVar, cast

import torch

from rsmem import settings

ALIGN = 64  # bytes between matrices in the arena: a cache line, what vector loads like
HUGE_PAGE = 2 << 20
MIN_BYTES = 16 << 20  # below this the copies are not worth it (and the small default model stays as it is)

T = TypeVar("T")

_arenas: set[int] = set()  # the storage addresses of the live arenas (see on_huge_pages)


def _enabled() -> bool:
    return hasattr(mmap, "MADV_HUGEPAGE") and settings.hugepages_enabled()


def _arena(specs: list[tuple[tuple[int, ...], torch.dtype]]) -> list[torch.Tensor] | None:
    """Zero tensors of the given shapes and dtypes, one after another (``ALIGN``-aligned) in one anonymous
    mapping advised ``MADV_HUGEPAGE`` (anonymous memory comes zero-filled); None when it cannot be had."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in specs]
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += -(-nbytes // ALIGN) * ALIGN
    try:
        arena = mmap.mmap(-1, total + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        arena.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # holds the mapping as long as any view lives
    key = raw.untyped_storage().data_ptr()
    _arenas.add(key)
    weakref.finalize(arena, _arenas.discard, key)  # the mapping outlives every view of it
    start = (-raw.data_ptr()) % HUGE_PAGE
    return [
        raw[start + off : start + off + nbytes].view(dtype).view(shape)
        for (shape, dtype), off, nbytes in zip(specs, offsets, sizes, strict=True)
    ]


def on_huge_pages(t: torch.Tensor) -> bool:
    """Whether ``t`` lies in an arena of this module (:func:`huge_page_copies`, :func:`huge_page_zeros`)."""
    return t.device.type == "cpu" and t.untyped_storage().data_ptr() in _arenas


def huge_page_copies(
    tensors: list[torch.Tensor], copied: Callable[[torch.Tensor], None] | None = None
) -> list[torch.Tensor]:
    """Contiguous CPU copies of ``tensors`` in one huge-page-advised mapping (the originals when the
    platform cannot, when any is not a contiguous CPU tensor, when they are small, or when every one is
    in such a mapping already: a loader put them there). ``copied`` is called with each original once
    its copy is made."""
    if not tensors or not _enabled() or sum(t.nbytes for t in tensors) < MIN_BYTES:
        return tensors
    if all(t.is_contiguous() and on_huge_pages(t) for t in tensors):
        return tensors
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        return tensors
    copies = _arena([(tuple(t.shape), t.dtype) for t in tensors])
    if copies is None:
        return tensors
    for dst, t in zip(copies, tensors, strict=True):
        dst.copy_(t)
        if copied is not None:
            copied(t)
    return copies


def huge_page_matrices(items: Sequence[T]) -> list[T]:
    """``items`` (a model's matrices) with every float32 CPU tensor that is contiguous, or the transposed
    view of a contiguous one, replaced by a copy of the same layout in one huge-page mapping
    (:func:`huge_page_copies`); anything else (None, quantized blocks, other dtypes or layouts) passes
    through. Views of one matrix (a tied head ``[in, out]`` beside its embedding ``[out, in]``) stay views
    of one copy. Where nothing is copied (small sets, no platform support) the items come back as they are."""
    found = [_contiguous_base(t) for t in items]
    keys = [None if b is None else (b.data_ptr(), tuple(b.shape)) for b in found]  # one copy a base
    bases = {key: b for key, b in zip(keys, found, strict=True) if key is not None and b is not None}
    originals = list(bases.values())
    copies = huge_page_copies(originals)
    if copies is originals:
        return list(items)
    copy_of = dict(zip(bases, copies, strict=True))
    return [
        t if key is None else cast(T, copy_of[key] if base is t else copy_of[key].t())
        for t, base, key in zip(items, found, keys, strict=True)
    ]


def _contiguous_base(t: object) -> torch.Tensor | None:
    """The contiguous float32 CPU tensor ``t`` is or is the transposed view of, else None."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32 or t.device.type != "cpu":
        return None
    if t.is_contiguous():
        return t
    return t.t() if t.dim() == 2 and t.t().is_contiguous() else None


def huge_page_zeros(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
    """CPU zero tensors of ``shapes``: in one huge-page mapping, allocated there directly (no copy, no
    second allocation: a server's state memory can be gigabytes), or plain ``torch.zeros`` when small or
    not available."""
    nbytes = sum(math.prod(s) for s in shapes) * dtype.itemsize
    tensors = _arena([(s, dtype) for s in shapes]) if shapes and _enabled() and nbytes >= MIN_BYTES else None
    return tensors if tensors is not None else [torch.zeros(s, dtype=dtype) for s in shapes]
