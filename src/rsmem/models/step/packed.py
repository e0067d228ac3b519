"""oneDNN copies of the float32 matrices: a packed twin for products of several rows (batched decode,
prefill) and, for one row (single-sequence decode), the plain ``[out, in]`` matrix itself.

oneDNN's blocked weights multiply 8 to 512 float32 rows faster than MKL's plain ``matmul``. For one row MKL's
product runs on one core, which cannot saturate memory bandwidth, while oneDNN's, on the plain ``[out, in]``
matrix, uses every core (the packed twin is slower there): models with packing hold their matrices
``[out, in]`` contiguous and pass their ``[in, out]`` transposed views (see :func:`held_matrix`), so the
one-row path costs no extra copy. A packed copy doubles those matrices' memory; ``RSMEM_ONEDNN=0`` in the
environment turns packing off.

``RSMEM_PACKED_TWINS=0`` keeps the layout but makes no packed copies: each weight is held once, and the
products of several rows run oneDNN on the plain ``[out, in]`` matrix, which it reorders on every call (the
same values as the packed twin's, each call slower by the reorder). Where a consumer needs a oneDNN packed
tensor (the C++ steps' packed and sliced forms), :meth:`PackedMatrices.twin` is the plain matrix and
``twin.is_mkldnn`` is False: they take the plain rows instead.

One-sequence decode steps of large models do not come here: :mod:`rsmem.models.step.compiled` runs them as
compiled reductions (:func:`rsmem.models.step.fused.gemv`), faster still.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

from rsmem import settings
from rsmem.hugepages import huge_page_matrices
from rsmem.models.ops.common import linear, transposed
from rsmem.models.ops.quantized import Matrix, QuantMatrix

PACK_ROWS = 8  # the row count oneDNN picks its blocking for; any count runs, 8..512 all gain


def packing_enabled() -> bool:
    return (
        settings.onednn_enabled()
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


@overload
def held_matrix(weight: torch.Tensor, dtype: torch.dtype, packing: bool) -> torch.Tensor: ...
@overload
def held_matrix(weight: QuantMatrix, dtype: torch.dtype, packing: bool) -> QuantMatrix: ...
@overload
def held_matrix(weight: Matrix, dtype: torch.dtype, packing: bool) -> Matrix: ...
def held_matrix(weight: Matrix, dtype: torch.dtype, packing: bool) -> Matrix:
    """How a model holds a ``[out, in]`` matrix: as an ``[in, out]`` tensor for :meth:`PackedMatrices.linear`.

    With ``packing`` (float32 only) it is the transposed view of the ``[out, in]`` contiguous matrix, which
    the one-row oneDNN product takes as it is (a float32 contiguous ``weight`` is not even copied);
    otherwise the ``[in, out]`` contiguous copy that :func:`~rsmem.models.ops.common.linear` prefers.
    """
    if isinstance(weight, QuantMatrix):  # kept in its blocks whatever the compute dtype
        return weight
    if packing and dtype == torch.float32:
        return weight.to(torch.float32).contiguous().t()
    return transposed(weight, dtype)


class PackedMatrices:
    """oneDNN twins of ``[in, out]`` float32 matrices; :meth:`linear` uses them where they are faster."""

    def __init__(self) -> None:
        # id(weight_t) -> (weight_t, packed (or the plain matrix itself), plain [out, in] contiguous or None)
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self.twins = settings.packed_twins_enabled()  # False: no packed copies (RSMEM_PACKED_TWINS=0)

    def add(self, weight_t: Matrix) -> None:
        """Pack ``weight_t`` ``[in, out]`` if it is a float32 CPU matrix (others use the plain product).

        When ``weight_t`` is the transposed view of a contiguous ``[out, in]`` matrix (:func:`held_matrix`),
        one-row products go through oneDNN on that matrix too: in a decode step every matrix streams from
        memory, and even Mamba's small ``x_proj`` (123k weights) gains over the plain product."""
        if not isinstance(weight_t, torch.Tensor):  # a QuantMatrix: its own kernels
            return
        if weight_t.dtype != torch.float32 or weight_t.device.type != "cpu":
            return
        weight = weight_t.t()
        plain = weight if weight.is_contiguous() else None
        if not self.twins:  # oneDNN on the plain matrix for every row count (None: the plain product)
            if plain is not None:
                self._by_id[id(weight_t)] = (weight_t, plain, plain)
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS)
        self._by_id[id(weight_t)] = (weight_t, packed, plain)

    def twin(self, weight_t: Matrix) -> torch.Tensor | None:
        """The packed copy of ``weight_t`` (the very tensor given to :meth:`add`; without twins its plain
        ``[out, in]`` matrix), or None."""
        entry = self._by_id.get(id(weight_t))
        return entry[1] if entry is not None and entry[0] is weight_t else None

    def linear(self, x: torch.Tensor, weight_t: Matrix) -> torch.Tensor:
        """``x @ weight_t`` as :func:`~rsmem.models.ops.common.linear` computes it, through the packed
        twin when there is one and ``x`` has more than one row, through the plain ``[out, in]`` matrix
        when ``x`` has one row and the matrix is held that way."""
        if isinstance(weight_t, QuantMatrix):
            return weight_t.matmul_t(x)
        entry = self._by_id.get(id(weight_t))
        if entry is None or entry[0] is not weight_t or x.dtype != torch.float32:
            return linear(x, weight_t)
        if x.numel() == x.shape[-1]:  # one row
            plain = entry[2]
            if plain is None:
                return linear(x, weight_t)
            out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
                x.contiguous(), plain, None, "none", [], ""
            )
            return out
        out = torch.ops.mkldnn._linear_pointwise(x.contiguous(), entry[1], None, "none", [], "")
        return out


class HeldMatrices:
    """A model's big matrices held as rsmem's Mamba models hold theirs (this module):
    ``[in, out]`` tensors in the compute dtype, float32 ones with oneDNN twins where packing is available
    (one-row products stream the ``[out, in]`` matrix, several rows use the packed copy)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.packing = packing_enabled()
        self.packed = PackedMatrices()

    def on_huge_pages(self, weights: Sequence[Any]) -> list[Any]:
        """``weights`` (``[out, in]`` matrices, None or quantized ones among them) with the tensors widened to
        float32 and put on one huge-page mapping (:func:`~rsmem.hugepages.huge_page_matrices`: a decode step
        streams every matrix, faster from 2 MiB pages) when :meth:`hold` keeps them as they are (float32
        with packing: :func:`held_matrix`); as they are otherwise, where :meth:`hold` copies them anyway."""
        if self.dtype != torch.float32 or not self.packing:
            return list(weights)
        return huge_page_matrices(
            [w.to(torch.float32).contiguous() if isinstance(w, torch.Tensor) else w for w in weights]
        )

    def hold(self, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` ``[out, in]`` as the ``[in, out]`` tensor :meth:`linear` takes."""
        weight_t = held_matrix(weight, self.dtype, self.packing)
        if self.packing:
            self.packed.add(weight_t)
        return weight_t

    def linear(self, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        """``x @ weight_t``, float32 out."""
        return self.packed.linear(x, weight_t)
