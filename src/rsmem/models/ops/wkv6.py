"""The RWKV-6 WKV recurrence (data-dependent diagonal decay with a "bonus" ``u`` for the current token):
one-token step, chunked prefill and the per-token reference twin.

Per head, with the state ``S`` ``[K, V]`` (llama.cpp's and the ``rwkv`` package's layout, ``[H, K, V]`` per
sequence), for each token:

    y = r^T (S + diag(u) k v^T)        S = diag(w) S + k v^T

``w = exp(log_w)`` with ``log_w = -exp(...)`` unbounded below. Inputs are ``[Bs, L, H, N]``, ``u`` ``[H, N]``,
states ``[Bs, H, N, N]``; the kernels update the state in place and return ``y`` ``[Bs, L, H, N]``.

The chunked form: within a chunk (``c_t`` the cumulative log-decay through token ``t``), token ``t`` reads
the chunk's initial state decayed by ``e^{c_{t-1}}`` and each earlier token ``s`` of the chunk through the
weight ``sum_j r_t[j] k_s[j] e^{c_{t-1}[j] - c_s[j]}``. Those pairwise decays are formed exactly (an
exponent per pair and channel, never above 0), since RWKV-6 decays are too strong to factor through one
reference point in float32; hence the smaller default chunk.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rsmem.models.ops.wkv import ONE_THREAD_CHUNK_WORK, chunked_layout, scan_ops
from rsmem.threads import one_thread_below


def wkv6_step_(
    state: torch.Tensor, r: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, u: torch.Tensor
) -> torch.Tensor:
    """One token of each sequence: ``r, w, k, v`` ``[Bs, H, N]`` (``w`` the decay itself), ``u`` ``[H, N]``;
    updates ``state`` ``[Bs, H, N, N]`` in place and returns ``y`` ``[Bs, H, N]``."""
    bs, h, n, _ = state.shape
    flat = state.view(bs * h, n, n)
    y = torch.bmm(r.reshape(bs * h, 1, n), flat).view(bs, h, n)  # r^T S, then the bonus: (r . u k) v
    y = y + (r * u * k).sum(-1, keepdim=True) * v
    flat.mul_(w.reshape(bs * h, n, 1)).addcmul_(k.reshape(bs * h, n, 1), v.reshape(bs * h, 1, n))
    return y


def wkv6_ref_(
    state: torch.Tensor,
    r: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
) -> torch.Tensor:
    """Token-by-token twin of :func:`wkv6_chunked_` (inputs ``[Bs, L, H, N]``)."""
    w = torch.exp(log_w)
    ys = [wkv6_step_(state, r[:, t], w[:, t], k[:, t], v[:, t], u) for t in range(r.shape[1])]
    return torch.stack(ys, dim=1)


def wkv6_intra(
    rc: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, lw: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """What each chunk contributes by itself, for chunks laid out ``[B, T, N]`` (``B`` = sequences x heads x
    chunks; ``u`` ``[B, 1, N]``): the outputs from the chunk's own tokens ``[B, T, V]``, ``r`` decayed to
    read the chunk's initial state ``[B, T, K]``, the chunk's whole decay ``[B, K]`` and what its tokens add
    to its final state ``[B, K, V]``. Written for inductor to fuse (compiled, the pairwise decays
    ``[B, T, T, N]`` become one reduction instead of a tensor)."""
    size = rc.shape[1]
    c = lw.cumsum(dim=1)
    c_prev = c - lw
    strict = torch.ones(size, size, dtype=torch.bool, device=rc.device).tril(-1)
    # e^{c_{t-1} - c_s} for s < t: [B, T, T, N], every exponent <= 0
    expo = (c_prev.unsqueeze(2) - c.unsqueeze(1)).masked_fill(~strict.unsqueeze(-1), float("-inf"))
    att = (expo.exp() * rc.unsqueeze(2) * kc.unsqueeze(1)).sum(-1)  # [B, T, T]
    bonus = (rc * kc * u).sum(-1, keepdim=True)  # the current token, through u
    intra = att @ vc + bonus * vc
    r_start = rc * torch.exp(c_prev)
    last = c[:, -1:]
    k_end = kc * torch.exp(last - c)
    return intra, r_start, torch.exp(last).squeeze(1), k_end.transpose(1, 2) @ vc


Intra = Callable[..., tuple[torch.Tensor, ...]]
# bytes of chunk-initial states :func:`wkv6_chunked_` keeps at once (a group of chunks; one sequence of 12
# heads of 64 holds 192 KiB a chunk). Small: a group as large as a whole prompt makes each state's copy
# into it land on fresh pages with its heads far apart, much slower than into a group that stays in cache
STATES_BYTES = 2 << 20


def wkv6_chunked_(
    state: torch.Tensor,
    r: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    chunk_size: int = 16,
    intra: Intra | None = None,
) -> torch.Tensor:
    """The recurrence over ``L`` tokens, parallel within chunks of ``chunk_size``: ``r, log_w, k, v``
    ``[Bs, L, H, N]``, ``u`` ``[H, N]``; updates ``state`` ``[Bs, H, N, N]`` in place and returns ``y``
    ``[Bs, L, H, N]``. Padding tokens (``k = v = 0``, no decay) leave the state unchanged.

    ``intra``: :func:`wkv6_intra` compiled (:mod:`rsmem.models.step.compiled`); with it every chunk is
    ``chunk_size`` tokens (a short prompt is padded), so that one compilation serves every prompt."""
    bs, length, h, n = r.shape
    size, n_chunks, chunks = chunked_layout(length, chunk_size, full=intra is not None)
    flat = (bs * h * n_chunks, size, n)
    rc, kc, vc, lw = (chunks(t).reshape(flat) for t in (r, k, v, log_w))
    uc = u.view(1, h, 1, 1, n).expand(bs, h, n_chunks, 1, n).reshape(flat[0], 1, n)
    parts = (intra or wkv6_intra)(rc, kc, vc, lw, uc)
    in_chunk, r_start, decay_all, kv_end = (
        t.view(bs, h, n_chunks, *t.shape[1:]) for t in parts
    )  # [Bs, H, C, T, V], [Bs, H, C, T, K], [Bs, H, C, K], [Bs, H, C, K, V]
    # The chunks' initial states do not depend on r: the loop only decays and adds (elementwise, on one
    # thread for a few sequences), and the chunks' reads of them are products over many chunks at once
    # (one [T, K] x [K, V] product a chunk at a time would pay a call's overhead for each)
    ys = []
    group = max(1, STATES_BYTES // max(1, state.numel() * state.element_size()))
    for c0 in range(0, n_chunks, group):
        c1 = min(n_chunks, c0 + group)
        starts = state.new_empty(bs, h, c1 - c0, n, n)
        with one_thread_below(state.numel(), ONE_THREAD_CHUNK_WORK):
            for i in range(c0, c1):
                starts[:, :, i - c0] = state
                state.mul_(decay_all[:, :, i].unsqueeze(-1)).add_(kv_end[:, :, i])
            ys.append(in_chunk[:, :, c0:c1] + r_start[:, :, c0:c1] @ starts)
    y = ys[0] if len(ys) == 1 else torch.cat(ys, dim=2)  # [Bs, H, C, T, V]
    return y.permute(0, 2, 3, 1, 4).reshape(bs, n_chunks * size, h, n)[:, :length]


def wkv6_prefill_(
    state: torch.Tensor,
    r: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    chunk_size: int = 16,
    intra: Intra | None = None,
) -> torch.Tensor:
    """:func:`wkv6_chunked_`'s contract, through the C++ scan (``rsmem_native::wkv6_scan``,
    ``kernels/csrc/wkv_scan.cpp``, ahead of the chunked
    kernel) where the kernels are loaded (:func:`~rsmem.models.ops.wkv.scan_ops`), else
    through the chunked kernel (``chunk_size``, ``intra``)."""
    ops = scan_ops(state, r, log_w, k, v, u)
    if ops is not None:
        return ops.wkv6_scan(state, *(t.contiguous() for t in (r, log_w, k, v, u)))
    return wkv6_chunked_(state, r, log_w, k, v, u, chunk_size, intra)
