"""oneDNN-packed copies of the float32 matrices, for products of several rows (batched decode, prefill).

Measured on this machine kind (torch 2.13, f32): oneDNN's blocked weights multiply 8 to 512 rows 1.3-2.5x
faster than MKL's plain ``matmul``; for one row the plain product is as fast or faster, so it stays. A
packed copy doubles those matrices' memory; ``RSMEM_ONEDNN=0`` in the environment turns packing off.
"""

from __future__ import annotations

import os

import torch

from rsmem.models.ops.common import linear

PACK_ROWS = 8  # the row count oneDNN picks its blocking for; any count runs, 8..512 all gain


def packing_enabled() -> bool:
    return (
        os.environ.get("RSMEM_ONEDNN", "1") != "0"
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedMatrices:
    """Packed twins of ``[in, out]`` float32 matrices; :meth:`linear` uses them for more than one row."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(weight_t) -> (weight_t, packed)

    def add(self, weight_t: torch.Tensor) -> None:
        """Pack ``weight_t`` ``[in, out]`` if it is a float32 CPU matrix (others use the plain product)."""
        if weight_t.dtype != torch.float32 or weight_t.device.type != "cpu":
            return
        packed = torch.ops.mkldnn._reorder_linear_weight(weight_t.t().contiguous(), PACK_ROWS)
        self._by_id[id(weight_t)] = (weight_t, packed)

    def linear(self, x: torch.Tensor, weight_t: torch.Tensor) -> torch.Tensor:
        """``x @ weight_t`` as :func:`~rsmem.models.ops.common.linear` computes it, through the packed
        twin when there is one and ``x`` has more than one row."""
        entry = self._by_id.get(id(weight_t))
        if entry is None or entry[0] is not weight_t or x.numel() == x.shape[-1] or x.dtype != torch.float32:
            return linear(x, weight_t)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), entry[1], None, "none", [], "")
