"""Dequantization of block-form rows in torch: the same float32 values as ``gguf.quants.dequantize``
(the same operations in the same order), for the reference twin and for the tests."""

from __future__ import annotations

import torch

from rsmem.kernels.formats import Q, block_shape, check_blocks


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per value (last dimension) as float16, widened to float32: ``[..., 2] -> [..., 1]``."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(b: torch.Tensor) -> torch.Tensor:
    """``[..., n]`` bytes -> ``[..., 2, n]``: the low nibbles, then the high ones."""
    return torch.stack((b & 0x0F, b >> 4), dim=-2)


def _scale_min_k4(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The eight 6-bit scales and mins of a Q4_K/Q5_K block from its 12 bytes ``[B, 12] -> [B, 8] x 2``."""
    d, m, m_d = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _bf16(b: torch.Tensor) -> torch.Tensor:
    """Two bytes per value (last dimension) as bfloat16, widened to float32: ``[..., 2] -> [..., 1]``."""
    return b.contiguous().view(torch.bfloat16).float()


def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return _f16(b[:, :2]) * b[:, 2:].contiguous().view(torch.int8).float()


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    q = _nibbles(b[:, 2:]).reshape(b.shape[0], 32).to(torch.int8) - 8
    return _f16(b[:, :2]) * q.float()


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).unsqueeze(-1)
    dm = (_f16(b[:, 2:4]) * mn.float()).unsqueeze(-1)
    q = _nibbles(b[:, 16:].reshape(n, 4, 32)).reshape(n, 8, 32).float()
    return (d * q - dm).reshape(n, 256)


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    sc, mn = _scale_min_k4(b[:, 4:16])
    d = (_f16(b[:, 0:2]) * sc.float()).unsqueeze(-1)
    dm = (_f16(b[:, 2:4]) * mn.float()).unsqueeze(-1)
    shifts = torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)
    qh = (b[:, 16:48].unsqueeze(1) >> shifts) & 1
    ql = _nibbles(b[:, 48:].reshape(n, 4, 32)).reshape(n, 8, 32)
    return (d * (ql | (qh << 4)).float() - dm).reshape(n, 256)


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    n = b.shape[0]
    scales = b[:, 192:208].contiguous().view(torch.int8).float()
    d = (_f16(b[:, 208:210]) * scales).unsqueeze(-1)
    ql = _nibbles(b[:, :128].reshape(n, 2, 64)).reshape(n, 8, 32)
    shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
    qh = ((b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).to(torch.int8) - 32
    return (d * q.reshape(n, 16, 16).float()).reshape(n, 256)


_BLOCK_DEQUANT = {
    Q.Q8_0: _q8_0,
    Q.Q4_0: _q4_0,
    Q.Q4_K: _q4_k,
    Q.Q5_K: _q5_k,
    Q.Q6_K: _q6_k,
    Q.F16: _f16,
    Q.BF16: _bf16,
}


def dequantize_rows(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``[N, row_bytes]`` uint8 rows of ``qtype`` blocks -> float32 ``[N, k]`` (gguf.quants.dequantize's
    values). ValueError for a type without a kernel, a ``k`` that is not a multiple of the block size or
    rows of the wrong length."""
    check_blocks(blocks, qtype, k)
    n = blocks.shape[0]
    fn = _BLOCK_DEQUANT[Q(qtype)]
    type_size = block_shape(qtype)[1]
    if n == 0:
        return torch.empty(0, k, dtype=torch.float32, device=blocks.device)
    return fn(blocks.reshape(-1, type_size)).reshape(n, k)
