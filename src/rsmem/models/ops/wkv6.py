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

import torch

from rsmem.models.ops.wkv import chunked_layout


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


def wkv6_chunked_(
    state: torch.Tensor,
    r: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    u: torch.Tensor,
    chunk_size: int = 16,
) -> torch.Tensor:
    """The recurrence over ``L`` tokens, parallel within chunks of ``chunk_size``: ``r, log_w, k, v``
    ``[Bs, L, H, N]``, ``u`` ``[H, N]``; updates ``state`` ``[Bs, H, N, N]`` in place and returns ``y``
    ``[Bs, L, H, N]``. Padding tokens (``k = v = 0``, no decay) leave the state unchanged."""
    bs, length, h, n = r.shape
    size, n_chunks, chunks = chunked_layout(length, chunk_size)
    rc, kc, vc, lw = (chunks(t) for t in (r, k, v, log_w))  # [Bs, H, C, T, N]
    c = lw.cumsum(dim=-2)
    c_prev = c - lw
    strict = torch.ones(size, size, dtype=torch.bool).tril(-1)
    # e^{c_{t-1} - c_s} for s < t: [Bs, H, C, T, T, N], every exponent <= 0
    expo = (c_prev.unsqueeze(-2) - c.unsqueeze(-3)).masked_fill(~strict.unsqueeze(-1), float("-inf"))
    att = (expo.exp_().mul_(rc.unsqueeze(-2)).mul_(kc.unsqueeze(-3))).sum(-1)  # [Bs, H, C, T, T]
    bonus = (rc * kc * u.view(1, h, 1, 1, n)).sum(-1, keepdim=True)  # the current token, through u
    intra = att @ vc + bonus * vc  # [Bs, H, C, T, V]
    r_start = rc * torch.exp(c_prev)  # reads the chunk's initial state
    last = c[..., -1:, :]
    k_end = kc * torch.exp(last - c)  # carries into the chunk's final state
    decay_all = torch.exp(last).squeeze(-2)  # [Bs, H, C, N]
    kv_end = k_end.transpose(-1, -2) @ vc  # [Bs, H, C, K, V]
    ys = []
    for i in range(n_chunks):
        ys.append(r_start[:, :, i] @ state + intra[:, :, i])
        state.copy_(state * decay_all[:, :, i].unsqueeze(-1) + kv_end[:, :, i])
    y = torch.stack(ys, dim=2)  # [Bs, H, C, T, V]
    return y.permute(0, 2, 3, 1, 4).reshape(bs, n_chunks * size, h, n)[:, :length]
