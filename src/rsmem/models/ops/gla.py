"""The gated linear attention of llama.cpp's ``rwkv6qwen2`` (QRWKV-6: ``ggml_gated_linear_attn``): one-token
step, chunked prefill and the per-token reference twin.

Per head, with the state ``S`` ``[K, V]`` (``[H, K, V]`` per sequence, as llama.cpp lays it out), for each
token: ``S = diag(w) S + k v^T``, then ``y = scale * q^T S`` (the output reads the state *after* the
token, unlike RWKV-6's). Inputs ``[Bs, L, H, N]``, states ``[Bs, H, N, N]`` updated in place.

The chunked form is RWKV-6's prompt kernel (:func:`~rsmem.models.ops.wkv6.wkv6_prefill_`: its C++ scan
or its chunked kernel; no bonus) on the tokens with ``q`` moved one place later: its output at ``t + 1`` is
``q_t`` times the state after token ``t``. One padding token at the end (no decay, ``k = v = 0``) gives the
last output and leaves the state as it is.
"""

from __future__ import annotations

import torch

from rsmem.models.ops.wkv6 import wkv6_prefill_


def gla_step_(
    state: torch.Tensor, q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """One token of each sequence: ``q, w, k, v`` ``[Bs, H, N]`` (``w`` the decay itself); updates
    ``state`` ``[Bs, H, N, N]`` in place and returns ``y`` ``[Bs, H, N]``."""
    bs, h, n, _ = state.shape
    flat = state.view(bs * h, n, n)
    flat.mul_(w.reshape(bs * h, n, 1)).addcmul_(k.reshape(bs * h, n, 1), v.reshape(bs * h, 1, n))
    return torch.bmm((q * scale).reshape(bs * h, 1, n), flat).view(bs, h, n)


def gla_ref_(
    state: torch.Tensor,
    q: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Token-by-token twin of :func:`gla_chunked_` (inputs ``[Bs, L, H, N]``)."""
    w = torch.exp(log_w)
    ys = [gla_step_(state, q[:, t], w[:, t], k[:, t], v[:, t], scale) for t in range(q.shape[1])]
    return torch.stack(ys, dim=1)


def gla_chunked_(
    state: torch.Tensor,
    q: torch.Tensor,
    log_w: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    chunk_size: int = 16,
) -> torch.Tensor:
    """The recurrence over ``L`` tokens, parallel within chunks (see the module): ``q, log_w, k, v``
    ``[Bs, L, H, N]``; updates ``state`` in place and returns ``y`` ``[Bs, L, H, N]``."""
    bs, _, h, n = q.shape
    pad = q.new_zeros(bs, 1, h, n)
    y = wkv6_prefill_(
        state,
        torch.cat([pad, q * scale], dim=1),
        torch.cat([log_w, pad], dim=1),
        torch.cat([k, pad], dim=1),
        torch.cat([v, pad], dim=1),
        q.new_zeros(h, n),
        chunk_size,
    )
    return y[:, 1:]
