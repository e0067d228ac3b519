"""The RWKV-7 WKV recurrence (a diagonal-plus-rank-one state transition): one-token step, chunked prefill
and the per-token reference twin.

Per head, with the state ``S`` ``[V, K]`` (llama.cpp's and the ``rwkv`` package's layout, ``[H, V, K]`` per
sequence), for each token:

    S = S @ (diag(w) + a b^T) + v k^T        y = S r

``w`` is the decay (``exp(log_w)``, ``log_w`` in ``[-exp(-0.5), 0]`` for RWKV-7), ``a = -kk`` and
``b = kk * iclr``. Inputs are ``[Bs, L, H, N]`` (``N`` the head size), states ``[Bs, H, N, N]``; the
kernels update the state in place and return ``y`` ``[Bs, L, H, N]``.

The chunked form (within a chunk of ``T`` tokens, ``c_t`` the cumulative log-decay up to token ``t``):
the term ``sa_t = S_{t-1} a_t`` of every token solves one unit lower-triangular system

    sa_t = S_0 (a_t e^{c_{t-1}})
           + sum_{s<t} [a_t . (b_s e^{c_{t-1}-c_s})] sa_s + [a_t . (k_s e^{c_{t-1}-c_s})] v_s

after which the outputs and the chunk's final state are products of ``[T, T]`` and ``[T, N]`` matrices, as in
a gated linear attention. Decays between two tokens are factored through the chunk's middle, so their
exponents stay within half a chunk's total decay (``T = 64``: ``e^{+-19.5}``, well inside float32).

:func:`wkv7_prefill_` is what a model calls for a prompt: the C++ scan (``rsmem_native::wkv7_scan``,
``kernels/csrc/wkv_scan.cpp``: token by token, each head's state in cache, the heads shared between
threads, ahead of the chunked kernel) where the kernels are loaded, else the chunked kernel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from rsmem.kernels.build import loaded_native_ops
from rsmem.models.ops.wkv_lowrank import unit_lower_inverse_one_thread
from rsmem.threads import one_thread_below


def wkv7_step_(
    state: torch.Tensor,
    r: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """One token of each sequence: ``r, w, k, v, a, b`` ``[Bs, H, N]`` (``w`` the decay itself); updates
    ``state`` ``[Bs, H, N, N]`` in place and returns ``y`` ``[Bs, H, N]``.

    Three passes over the state: both products read the old state (``y = S (w r) + sa (b . r) + v (k . r)``
    with ``sa = S a``), as row vectors times ``S^T`` (the batched product that reduces along the state's
    contiguous dimension, which beats ``S @ x``), then the
    decay and the two rank-one updates in place."""
    bs, h, n, _ = state.shape
    flat = state.view(bs * h, n, n)
    rows = torch.stack([a, w * r], dim=-2).view(bs * h, 2, n)
    sa, s_wr = torch.bmm(rows, flat.transpose(1, 2)).view(bs, h, 2, n).unbind(-2)  # [Bs, H, V] each
    y = s_wr + sa * (b * r).sum(-1, keepdim=True) + v * (k * r).sum(-1, keepdim=True)
    flat.mul_(w.reshape(bs * h, 1, n))
    flat.addcmul_(sa.reshape(bs * h, n, 1), b.reshape(bs * h, 1, n))
    flat.addcmul_(v.reshape(bs * h, n, 1), k.reshape(bs * h, 1, n))
    return y


def wkv7_ref_(
    state: torch.Tensor,
    r: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
) -> torch.Tensor:
    """Token-by-token twin of :func:`wkv7_chunked_` (inputs ``[Bs, L, H, N]``)."""
    w = torch.exp(log_w)
    ys = [wkv7_step_(state, r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t]) for t in range(r.shape[1])]
    return torch.stack(ys, dim=1)


def chunked_layout(
    length: int, chunk_size: int, full: bool = False
) -> tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]:
    """The chunk length and count for ``length`` tokens, and the function that lays out an input
    ``[Bs, L, H, N]`` as ``[Bs, H, n_chunks, size, N]`` (zero-padded at the end). The chunk length is
    ``chunk_size``, or ``length`` when shorter unless ``full``."""
    size = chunk_size if full else min(chunk_size, length)
    n_chunks = -(-length // size)

    def chunks(x: torch.Tensor) -> torch.Tensor:
        bs, _, h, n = x.shape
        x = F.pad(x, (0, 0, 0, 0, 0, n_chunks * size - length))
        return x.view(bs, n_chunks, size, h, n).permute(0, 3, 1, 2, 4)

    return size, n_chunks, chunks


def wkv7_intra(
    rc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, ac: torch.Tensor, bc: torch.Tensor, lw: torch.Tensor
) -> tuple[torch.Tensor, ...]:
    """What each chunk computes by itself, for chunks laid out ``[B, T, N]`` (``B`` = sequences x heads x
    chunks): the solver of the ``sa`` system ``[B, T, T]``, ``a`` and ``r`` decayed to read the chunk's
    initial state ``[B, T, K]``, the masked ``r . b`` weights ``[B, T, T]``, the ``a . k`` and ``r . k``
    terms times ``v`` ``[B, T, V]``, ``b`` decayed to the chunk's end ``[B, T, K]``, the chunk's whole
    decay ``[B, K]`` and what its keys add to its final state ``[B, V, K]``. Written for inductor to fuse
    (its exponentials and masks) when compiled."""
    size = rc.shape[1]
    c = lw.cumsum(dim=1)  # c_t, inclusive
    c_prev = c - lw  # c_{t-1}
    mid = c[:, size // 2 : size // 2 + 1]  # reference point: exponents stay within half a chunk
    last = c[:, -1:]
    a_dec = ac * torch.exp(c_prev - mid)
    r_dec = rc * torch.exp(c - mid)
    b_inv = bc * torch.exp(mid - c)
    k_inv = kc * torch.exp(mid - c)
    strict = torch.ones(size, size, dtype=torch.bool, device=rc.device).tril(-1)
    incl = torch.ones(size, size, dtype=torch.bool, device=rc.device).tril(0)
    a_ab = (a_dec @ b_inv.transpose(1, 2)).masked_fill(~strict, 0.0)  # [B, T, T]
    a_ak = (a_dec @ k_inv.transpose(1, 2)).masked_fill(~strict, 0.0)
    a_rb = (r_dec @ b_inv.transpose(1, 2)).masked_fill(~incl, 0.0)
    a_rk = (r_dec @ k_inv.transpose(1, 2)).masked_fill(~incl, 0.0)
    solver = unit_lower_inverse_one_thread(a_ab)  # (I - a_ab)^-1
    a_start = ac * torch.exp(c_prev)  # a_t e^{c_{t-1}}: reads the chunk's initial state
    r_start = rc * torch.exp(c)
    b_end = bc * torch.exp(last - c)  # b_s e^{c_T - c_s}: carries into the chunk's final state
    k_end = kc * torch.exp(last - c)
    kv_end = vc.transpose(1, 2) @ k_end  # [B, V, K]
    return solver, a_start, r_start, a_rb, a_ak @ vc, a_rk @ vc, b_end, torch.exp(last).squeeze(1), kv_end


# multiply-adds of one of the chunk loop's products below which the loop runs on one thread (1.6M for one
# sequence of 12 heads of 64 in chunks of 32)
ONE_THREAD_CHUNK_WORK = 1 << 23


def wkv7_chunked_(
    state: torch.Tensor,
    r: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    chunk_size: int = 64,
    intra: Callable[..., tuple[torch.Tensor, ...]] | None = None,
) -> torch.Tensor:
    """The recurrence over ``L`` tokens, parallel within chunks of ``chunk_size``: ``r, log_w, k, v, a, b``
    ``[Bs, L, H, N]``; updates ``state`` ``[Bs, H, N, N]`` in place and returns ``y`` ``[Bs, L, H, N]``.

    Padding tokens (``k = v = a = b = 0``, no decay) leave the state unchanged. ``intra``:
    :func:`wkv7_intra` compiled (:mod:`rsmem.models.step.compiled`); with it every chunk is ``chunk_size``
    tokens
    (a short prompt is padded), so that one compilation serves every prompt."""
    bs, length, h, n = r.shape
    size, n_chunks, chunks = chunked_layout(length, chunk_size, full=intra is not None)
    flat = (bs * h * n_chunks, size, n)
    parts = (intra or wkv7_intra)(*(chunks(t).reshape(flat) for t in (r, k, v, a, b, log_w)))
    solver, a_start, r_start, a_rb, ak_v, rk_v, b_end, decay_all, kv_end = (
        t.view(bs, h, n_chunks, *t.shape[1:]) for t in parts
    )  # each [Bs, H, C, ...]
    ys = []
    # the loop's products are small for a few sequences ([T, N] x [N, N] a head): on one thread, not handed
    # to a sleeping partner, whose wake-up costs more than such a product
    with one_thread_below(bs * h * size * n * n, ONE_THREAD_CHUNK_WORK):
        for i in range(n_chunks):
            s_t = state.transpose(-1, -2)  # [Bs, H, K, V]
            sa = solver[:, :, i] @ (a_start[:, :, i] @ s_t + ak_v[:, :, i])  # [Bs, H, T, V]
            ys.append(r_start[:, :, i] @ s_t + a_rb[:, :, i] @ sa + rk_v[:, :, i])
            new = state * decay_all[:, :, i].unsqueeze(-2) + sa.transpose(-1, -2) @ b_end[:, :, i]
            state.copy_(new + kv_end[:, :, i])
    y = torch.stack(ys, dim=2)  # [Bs, H, C, T, V]
    return y.permute(0, 2, 3, 1, 4).reshape(bs, n_chunks * size, h, n)[:, :length]


def scan_ops(*tensors: torch.Tensor) -> Any:
    """The loaded kernels when the C++ scans take these tensors (float32, CPU, the state contiguous), else
    None (never builds them: the chunked kernels serve until something else has)."""
    ops = loaded_native_ops()
    if ops is None or not hasattr(ops, "wkv7_scan") or not tensors[0].is_contiguous():
        return None
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return None
    return ops


def wkv7_prefill_(
    state: torch.Tensor,
    r: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    chunk_size: int = 64,
    intra: Callable[..., tuple[torch.Tensor, ...]] | None = None,
) -> torch.Tensor:
    """:func:`wkv7_chunked_`'s contract, through the C++ scan where the kernels are loaded
    (:func:`scan_ops`), else through the chunked kernel (``chunk_size``, ``intra``)."""
    ops = scan_ops(state, r, log_w, k, v, a, b)
    if ops is not None:
        return ops.wkv7_scan(state, *(t.contiguous() for t in (r, log_w, k, v, a, b)))
    return wkv7_chunked_(state, r, log_w, k, v, a, b, chunk_size, intra)
