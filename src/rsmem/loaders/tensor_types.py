"""GGUF tensor types: which ones load, how each is held in memory, and the checks on their bytes.

Every float type and every quantized type the ``gguf`` package can dequantize loads (Q4_0 ... Q8_0, the
K-quants Q2_K ... Q6_K, the IQ and TQ types, MXFP4, NVFP4). For the architectures whose models multiply
quantized matrices (:data:`KEEPING_ARCHS`), the matrices of the types :mod:`rsmem.kernels` has kernels for
(Q8_0, Q4_0, Q4_K, Q5_K, Q6_K) stay in their blocks, as :class:`~rsmem.models.ops.quantized.QuantMatrix`:
the resident weights are the file's bytes. So do their F16 and BF16 matrices (2 bytes a value, widened to
float32 in the kernels' registers) when the C++ kernels are available (:func:`half_kernels`; without them,
RSMEM_KERNELS=0 or no compiler, they are converted to float32 at load). Every other quantized tensor is
dequantized once, at load, with gguf-py's reference dequantizer (the one llama.cpp's own Python tools use)
into float32; the model then casts its matrices to its compute dtype (bfloat16 with
``dtype=torch.bfloat16``). :data:`HOLDING` and :func:`holding_of` say how each type is held.

A tensor whose bytes are short (a truncated file), whose rows do not fill whole blocks, whose type rsmem
cannot read, or whose dequantized values are not finite (corrupt block scales) is refused with a
ModelFormatError naming the tensor.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import torch

from rsmem.errors import ModelFormatError
from rsmem.hugepages import huge_page_copies
from rsmem.kernels.build import native_ops
from rsmem.kernels.formats import HALF_TYPES, KERNEL_TYPES
from rsmem.models.ops.quantized import QuantMatrix

log = logging.getLogger("rsmem.loaders")
Q = gguf.GGMLQuantizationType


class Holding(Enum):
    """How a tensor type is held once loaded."""

    AS_STORED = "float32, as stored"
    CONVERTED = "converted to float32 at load"
    DEQUANTIZED = "dequantized to float32 at load"
    KEPT = "kept in its blocks (rsmem's kernels)"
    KEPT_2BYTES = "kept as stored, 2 bytes a value (rsmem's kernels)"
    REQUANTIZED = "requantized to Q8_0 at load (rsmem's kernels)"


FLOAT_TYPES = {
    Q.F32: Holding.AS_STORED,
    Q.F16: Holding.CONVERTED,
    Q.BF16: Holding.CONVERTED,
    Q.F64: Holding.CONVERTED,
}


def _dequantizable(qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether gguf-py dequantizes ``qtype`` (asked with one zero block: its public API has no list)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    if block_size == 1:  # F32, F16, BF16, F64 and the integer types: not quantized
        return False
    try:
        gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


HOLDING: dict[gguf.GGMLQuantizationType, Holding] = {
    **FLOAT_TYPES,
    **{t: Holding.DEQUANTIZED for t in Q if _dequantizable(t)},
}


def half_kernels() -> bool:
    """Whether F16 and BF16 matrices stay 2 bytes a value: the C++ kernels are built and loaded (builds
    them on first use; without them a product would widen the whole matrix each time, so the loaders
    convert such matrices to float32 once instead)."""
    return native_ops() is not None


def holding_of(qtype: gguf.GGMLQuantizationType, keep: bool) -> Holding | None:
    """How a tensor type is held: as :data:`HOLDING` says, or in its blocks when ``keep`` (a model that
    multiplies quantized matrices) and rsmem has kernels for the type (``KERNEL_TYPES``; F16 and BF16 only
    when :func:`half_kernels`)."""
    if keep and qtype in HALF_TYPES:
        return Holding.KEPT_2BYTES if half_kernels() else HOLDING.get(qtype)
    if keep and qtype in KERNEL_TYPES:
        return Holding.KEPT
    if keep and HOLDING.get(qtype) is Holding.DEQUANTIZED:
        return Holding.REQUANTIZED
    return HOLDING.get(qtype)


def loadable_type_names() -> list[str]:
    return [t.name for t in HOLDING]


class PastEndError(ValueError):
    """A read of bytes ``start`` to ``end`` of a file of ``size`` bytes: truncated, or a corrupt length
    or offset."""

    def __init__(self, start: int, end: int, size: int) -> None:
        super().__init__(f"needs bytes {start} to {end}, past the end of the file ({size} bytes)")


class TensorDataError(ValueError):
    """gguf's reader failed on one tensor (short data, rows not a whole number of blocks, unknown type)."""

    def __init__(self, name: str, cause: BaseException) -> None:
        if isinstance(cause, PastEndError):
            message = f"tensor {name!r} is truncated or corrupt: its data {cause}"
        else:
            message = f"tensor {name!r} is truncated or corrupt ({type(cause).__name__}: {cause})"
        super().__init__(message)
        self.name = name


class HeaderError(ValueError):
    """gguf's reader failed in the file's metadata or tensor table; ``part`` says where."""

    def __init__(self, part: str, cause: BaseException) -> None:
        if isinstance(cause, PastEndError):
            message = f"truncated or corrupt GGUF file: {part} {cause}"
        else:
            message = f"corrupt GGUF file: {part}: {type(cause).__name__}: {cause}"
        super().__init__(message)


class TensorNamingReader(gguf.GGUFReader):
    """gguf's reader, building the tensor views one at a time so that a failure names its tensor (the
    stock reader reports a truncated file as a bare numpy reshape error), and refusing every read past the
    end of the file (:class:`PastEndError`; the stock reader slices the memory map short and fails later
    in numpy), so a truncated or corrupt header says where it broke (:class:`HeaderError`). It overrides
    the reader's ``_get``, ``_push_field``, ``_build_tensor_info`` and ``_build_tensors(start_offs,
    fields)`` of gguf 0.19 (pinned in pyproject.toml), which calls the last once with every tensor-info
    field; a test truncates a file inside each of two tensors."""

    _part = "the file's header"

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            super().__init__(path)
        except TensorDataError:
            raise
        except Exception as exc:
            raise HeaderError(self._part, exc) from exc

    def _get(self, offset: int, dtype: Any, count: int = 1, override_order: Any = None) -> Any:
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if end > self.data.shape[0]:
            raise PastEndError(int(offset), end, int(self.data.shape[0]))
        return super()._get(offset, dtype, count, override_order)

    def _push_field(self, field: gguf.ReaderField, skip_sum: bool = False) -> int:
        size = super()._push_field(field, skip_sum)
        if field.name == "GGUF.kv_count":
            self._part = "the metadata's first key"
        elif not field.name.startswith("GGUF."):
            self._part = f"the metadata after key {field.name!r}"
        return size

    def _build_tensor_info(self, offs: int, count: int) -> tuple[int, list[Any]]:
        self._part = "the tensor table"
        return super()._build_tensor_info(offs, count)

    def _build_tensors(self, start_offs: int, fields: list[Any]) -> None:
        self._part = "the tensor data"
        built: list[gguf.ReaderTensor] = []
        for field in fields:
            name = bytes(field.parts[1]).decode("utf-8", "replace")
            try:
                super()._build_tensors(start_offs, [field])
            except Exception as exc:
                raise TensorDataError(name, exc) from exc
            built.extend(self.tensors)
        seen: set[str] = set()
        for t in built:
            if t.name in seen:
                raise ValueError(f"duplicated tensor name {t.name!r}")
            seen.add(t.name)
        self.tensors = built


def open_reader(path: str | os.PathLike[str]) -> gguf.GGUFReader:
    """The file's reader; a truncated or corrupt header or tensor raises ModelFormatError saying where
    (any other failure of the reader propagates for the caller to report)."""
    try:
        return TensorNamingReader(path)
    except (TensorDataError, HeaderError) as exc:
        raise ModelFormatError(f"{path}: {exc}") from exc


def hold(
    t: gguf.ReaderTensor, source: str | os.PathLike[str], keep: bool = False, view: bool = False
) -> torch.Tensor | QuantMatrix:
    """The tensor as float32 in numpy order (ggml's shape reversed: a Linear weight reads ``[out, in]``),
    held as :data:`HOLDING` says, or, with ``keep``, a matrix of a kernel type as a :class:`QuantMatrix`
    of the file's blocks (as :func:`holding_of` says); ModelFormatError names the tensor if its type or
    bytes are unusable. ``view``: float32 data as a read-only view of the file's mapping, not a copy (for
    :func:`load_tensors`'s arena, which copies it once)."""
    if keep and len(t.shape) == 2 and holding_of(t.tensor_type, keep) in (Holding.KEPT, Holding.KEPT_2BYTES):
        return _keep(t, source)
    values = _float32(t, source, view)
    if keep and len(t.shape) == 2 and HOLDING.get(t.tensor_type) is Holding.DEQUANTIZED:
        return _requantized(values)
    return values


def _requantized(values: torch.Tensor) -> QuantMatrix:
    """A matrix of a quantized type without a kernel, as Q8_0 blocks (gguf's quantizer, llama.cpp's
    bytes): a quarter of float32's memory, within half a step of 1/127 of each block's largest value."""
    blocks = gguf.quants.quantize(values.numpy(), Q.Q8_0)
    n_out, n_in = values.shape
    return QuantMatrix(torch.from_numpy(np.ascontiguousarray(blocks)), int(Q.Q8_0), (n_out, n_in))


def _float32(t: gguf.ReaderTensor, source: str | os.PathLike[str], view: bool = False) -> torch.Tensor:
    """The tensor as float32 (see :func:`hold`)."""
    holding = HOLDING.get(t.tensor_type)
    if holding is None:
        raise ModelFormatError(
            f"{source}: tensor {t.name!r} has type {t.tensor_type.name}, which rsmem cannot load "
            f"(loadable: {', '.join(loadable_type_names())})"
        )
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    _check_size(t, source)
    try:
        with np.errstate(all="ignore"):  # non-finite values are reported below, by tensor
            if t.tensor_type == Q.F64:
                data = np.asarray(t.data, dtype=np.float32)
            else:
                data = gguf.quants.dequantize(t.data, t.tensor_type)
        arr = np.ascontiguousarray(data, dtype=np.float32).reshape(shape)
    except Exception as exc:
        raise ModelFormatError(f"{source}: tensor {t.name!r} is truncated or corrupt ({exc})") from exc
    # F32 data is a view of the file's memory map: copy it (unless asked for the view); dequantized arrays
    # are already fresh
    if np.may_share_memory(arr, t.data) and not view:
        arr = arr.copy()
    with warnings.catch_warnings():  # a view of the read-only map: torch warns that it is not writable
        warnings.simplefilter("ignore", UserWarning)
        tensor = torch.from_numpy(arr)
    if holding is Holding.DEQUANTIZED and not bool(torch.isfinite(tensor).all()):
        raise ModelFormatError(
            f"{source}: tensor {t.name!r} ({t.tensor_type.name}) dequantizes to non-finite values: "
            "its block scales are corrupt"
        )
    return tensor


def _keep(t: gguf.ReaderTensor, source: str | os.PathLike[str]) -> QuantMatrix:
    """A matrix of a kernel type as its blocks, copied out of the file's memory map (one row of
    ``row_bytes`` per output); non-finite block scales are refused as :func:`hold` refuses them (F16 and
    BF16 values, like their float32 conversion, are not checked)."""
    _check_size(t, source)
    n_in, n_out = (int(d) for d in t.shape.tolist())
    data = np.array(t.data)  # a copy; gguf's reader gives F16 as float16 values, the others as bytes
    blocks = torch.from_numpy(data.view(np.uint8).reshape(n_out, -1))
    matrix = QuantMatrix(blocks, int(t.tensor_type), (n_out, n_in))
    if t.tensor_type in KERNEL_TYPES and not _scales_finite(blocks, t.tensor_type):
        raise ModelFormatError(
            f"{source}: tensor {t.name!r} ({t.tensor_type.name}) dequantizes to non-finite values: "
            "its block scales are corrupt"
        )
    return matrix


# Byte offsets of the f16 scales inside one block of each kernel type (ggml-common.h). A value is
# non-finite exactly when one of its block's scales is (the quants are small integers, and finite f16
# scales times them stay far inside float32's range), so checking the scales checks every value without
# dequantizing the matrix.
SCALE_OFFSETS = {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _scales_finite(blocks: torch.Tensor, qtype: gguf.GGMLQuantizationType) -> bool:
    """Whether every block scale of a ``[N, row_bytes]`` matrix of a kernel type is finite."""
    type_size = gguf.GGML_QUANT_SIZES[qtype][1]
    per_block = blocks.view(-1, type_size)
    for offset in SCALE_OFFSETS[qtype]:
        scales = per_block[:, offset : offset + 2].contiguous().view(torch.float16)
        if not bool(torch.isfinite(scales).all()):
            return False
    return True


def _check_size(t: gguf.ReaderTensor, source: str | os.PathLike[str]) -> None:
    block_size, type_size = gguf.GGML_QUANT_SIZES[t.tensor_type]
    row = int(t.shape[0]) if len(t.shape) else 1
    if row % block_size:
        raise ModelFormatError(
            f"{source}: tensor {t.name!r} ({t.tensor_type.name}) has rows of {row} values, not a whole "
            f"number of {block_size}-value blocks"
        )
    want = int(t.n_elements) // block_size * type_size
    if t.data.nbytes != want:
        raise ModelFormatError(
            f"{source}: tensor {t.name!r} ({t.tensor_type.name}) holds {t.data.nbytes} bytes, "
            f"expected {want} (truncated?)"
        )


@dataclass(frozen=True, slots=True)
class TypeSummary:
    """The tensors of one ggml type in a file, and how they are held once loaded."""

    type_name: str
    tensors: int
    values: int
    file_bytes: int
    holding: Holding | None  # None: the type does not load

    @property
    def held_bytes(self) -> int:
        if self.holding in (Holding.KEPT, Holding.KEPT_2BYTES):
            return self.file_bytes
        if self.holding is Holding.REQUANTIZED:
            return self.values // 32 * 34
        return 4 * self.values if self.holding is not None else 0


def summarize(tensors: Iterable[gguf.ReaderTensor], keep: bool = False) -> list[TypeSummary]:
    """One :class:`TypeSummary` per tensor type, most values first (``keep``: see :func:`hold`; a type
    is summarised as kept when its matrices are, its 1-D tensors being few bytes)."""
    counts: dict[gguf.GGMLQuantizationType, list[int]] = {}
    for t in tensors:
        c = counts.setdefault(t.tensor_type, [0, 0, 0])
        c[0] += 1
        c[1] += int(t.n_elements)
        c[2] += int(t.n_bytes)
    rows = [TypeSummary(q.name, n, v, b, holding_of(q, keep)) for q, (n, v, b) in counts.items()]
    return sorted(rows, key=lambda s: -s.values)


def file_summary(path: str | os.PathLike[str], keep: bool | None = None) -> list[TypeSummary]:
    """The tensor types of a GGUF file (reads the header and tensor table only); ``keep`` None: whether
    the file's architecture keeps quantized matrices (:data:`KEEPING_ARCHS`)."""
    reader = open_reader(path)
    if keep is None:
        field = reader.fields.get("general.architecture")
        arch = bytes(field.parts[field.data[0]]).decode("utf-8", "replace") if field is not None else ""
        keep = keeps_quantized(arch)
    return summarize(reader.tensors, keep)


# Architectures whose models multiply QuantMatrix weights (the others get float32 matrices).
KEEPING_ARCHS = ("mamba", "mamba2")


def keeps_quantized(arch: str) -> bool:
    """Whether ``arch``'s model keeps quantized matrices in their blocks (``RSMEM_KERNELS=0`` does not
    change this: the reference twin then multiplies them)."""
    return arch in KEEPING_ARCHS


def dequantized_note(source: str | os.PathLike[str], summary: Sequence[TypeSummary]) -> str | None:
    """The one line saying which quantized types of a file were dequantized (to float32, or requantized to
    Q8_0 for a model that multiplies quantized matrices), or None if none were."""
    lines = []
    for holding, what in ((Holding.DEQUANTIZED, "dequantized"), (Holding.REQUANTIZED, "requantized")):
        parts = [
            f"{s.type_name} ({s.tensors} tensor{'s' if s.tensors != 1 else ''})"
            for s in summary
            if s.holding is holding
        ]
        if parts:
            lines.append(f"{what} {', '.join(parts)} to {'Q8_0' if what == 'requantized' else 'float32'}")
    if not lines:
        return None
    return f"{Path(source).name}: {'; '.join(lines)} at load"


def load_tensors(
    reader: gguf.GGUFReader, source: str | os.PathLike[str], keep: bool = False, arena: bool = False
) -> dict[str, torch.Tensor | QuantMatrix]:
    """Every tensor of the file by name, held as :data:`HOLDING` says (with ``keep``, the matrices of
    kernel types as :class:`QuantMatrix`); logs one line (INFO, logger ``rsmem.loaders``) naming the
    types that were dequantized.

    ``arena``: the float32 matrices stored F32 are copied from the file straight into one huge-page
    mapping (:func:`~rsmem.hugepages.huge_page_copies`), where a model that keeps them as they are
    leaves them (it would copy them there itself: a second copy while it loads); small sets, or a
    platform without huge pages, get plain copies. Each matrix's pages of the file's mapping are
    dropped from the process once copied (they would count in its resident memory beside the copies
    until the reader is gone)."""
    mapped = [t.name for t in reader.tensors if arena and t.tensor_type == Q.F32 and len(t.shape) == 2]
    viewed = set(mapped)
    tensors = {t.name: hold(t, source, keep, view=t.name in viewed) for t in reader.tensors}
    if mapped:
        views = [tensors[name] for name in mapped]
        copies = huge_page_copies(views, _page_dropper(reader))  # type: ignore[arg-type]  # float32 tensors
        if copies is views:
            copies = [v.clone() for v in views]  # type: ignore[union-attr]
        tensors.update(zip(mapped, copies, strict=True))
    note = dequantized_note(source, summarize(reader.tensors, keep))
    if note:
        log.info(note)
    return tensors


def _page_dropper(reader: gguf.GGUFReader) -> Callable[[torch.Tensor], None] | None:
    """A function that drops a view's pages of the reader's (read-only) mapping from the process
    (``MADV_DONTNEED``: a later read faults them in again from the file), or None where it cannot."""
    mapping = getattr(reader.data, "_mmap", None)  # numpy's memmap keeps its mmap.mmap here
    if mapping is None or not hasattr(mmap, "MADV_DONTNEED"):
        return None
    base, size, page = int(reader.data.ctypes.data), int(reader.data.nbytes), mmap.PAGESIZE

    def drop(view: torch.Tensor) -> None:
        start = view.data_ptr() - base
        if start >= 0 and start + view.nbytes <= size:
            first = start // page * page
            with contextlib.suppress(OSError, ValueError):
                mapping.madvise(mmap.MADV_DONTNEED, first, start + view.nbytes - first)

    return drop
