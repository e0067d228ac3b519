"""QuantMatrix.rows, a quantized embedding's lookup: the C++ decoder where the kernels are loaded, the torch
one otherwise, the same float32 values (gguf's) either way, in the shape of the index."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from rsmem.kernels import KERNEL_TYPES, build
from rsmem.kernels.formats import block_shape
from rsmem.models.ops.quantized import QuantMatrix

pytestmark = pytest.mark.compiled

Q = gguf.GGMLQuantizationType


def random_matrix(qtype: Q, n: int, k: int) -> QuantMatrix:
    rng = np.random.default_rng(int(qtype))
    bs, ts = block_shape(qtype)
    b = rng.integers(0, 256, (n, k // bs, ts), dtype=np.uint8)
    d = (rng.random((n, k // bs)) * 0.02 + 1e-3).astype(np.float16).view(np.uint8).reshape(n, k // bs, 2)
    for off in {Q.Q8_0: (0,), Q.Q4_0: (0,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}[qtype]:
        b[:, :, off : off + 2] = d
    return QuantMatrix(torch.from_numpy(b.reshape(n, -1).copy()), qtype, (n, k))


@pytest.mark.parametrize("kernels", ["1", "0"])
@pytest.mark.parametrize("qtype", KERNEL_TYPES, ids=lambda t: t.name)
def test_rows_are_gguf_values(monkeypatch: pytest.MonkeyPatch, qtype: Q, kernels: str) -> None:
    monkeypatch.setenv("RSMEM_KERNELS", kernels)
    build.reset()
    try:
        if kernels == "1" and build.native_ops() is None:
            pytest.skip(f"kernels not built here: {build.build_error()}")
        matrix = random_matrix(qtype, 11, 512)
        index = torch.tensor([[3, 0], [10, 3]])
        got = matrix.rows(index)
        want = torch.from_numpy(gguf.quants.dequantize(matrix.blocks.numpy(), qtype))[index]
        assert got.shape == (2, 2, 512) and got.dtype == torch.float32
        assert torch.equal(got, want)
    finally:
        build.reset()
