"""Mamba-1's selective scan: ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t``, ``y_t = C_t h_t + D x_t``.

Shapes: ``x``, ``dt`` ``[Bs, L, D]`` (``dt`` after softplus), ``A`` ``[D, N]`` (``-exp(A_log)``), ``B``, ``C``
``[Bs, L, N]``, ``D`` ``[D]``, state ``h`` ``[Bs, D, N]`` (llama.cpp's ggml ``[N, D]`` row). Every ``(d, n)``
pair decays at its own rate, so unlike Mamba-2 there is no matrix form; the chunked scan below replaces the
per-token loop with cumulative sums inside chunks, in log space.
"""

from __future__ import annotations

import itertools

import torch

from rsmem.models.ops.common import CapturePoints, scan_tokens, states_at_ref

# Inside a chunk the scan divides by exp(E_t), the decay accumulated since the chunk's first token.
# Chunks end before that passes exp(-60), far from float32's limit (exp(88)): nothing overflows.
MAX_LOG_DECAY = 60.0


def selective_state_step(
    h: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of every sequence: ``x``, ``dt`` ``[Bs, D]``, ``B``, ``C`` ``[Bs, N]`` -> ``(y, new h)``."""
    dA = torch.exp(dt.unsqueeze(-1) * A)  # [Bs, D, N]
    h = h * dA + (dt * x).unsqueeze(-1) * B.unsqueeze(1)
    y = (h * C.unsqueeze(1)).sum(-1)
    return y + D * x, h


def selective_state_update_(
    h: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """:func:`selective_state_step` with ``h`` updated in place (decode); returns ``y`` ``[Bs, D]``."""
    dA = torch.exp_(dt.unsqueeze(-1) * A)  # [Bs, D, N]
    h.mul_(dA).addcmul_((dt * x).unsqueeze(-1), B.unsqueeze(1))
    y = torch.bmm(C.unsqueeze(1), h.transpose(1, 2)).squeeze(1)  # C^T h^T: reduces along h's contiguous dim
    return torch.addcmul(y, D, x)


def selective_scan_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token twin of :func:`selective_scan` (the recurrence as written in the paper)."""
    return scan_tokens(selective_state_step, x, dt, A, B, C, D, h)


def cumsum_(t: torch.Tensor) -> torch.Tensor:
    """Cumulative sum over dimension 1, in place, as ``L - 1`` vectorised adds: ``torch.cumsum`` along a
    dimension that is not the innermost does not vectorise on CPU."""
    for k in range(1, t.shape[1]):
        t[:, k].add_(t[:, k - 1])
    return t


def chunk_bounds(max_decay: list[float], max_chunk: int, max_log_decay: float = MAX_LOG_DECAY) -> list[int]:
    """Chunk starts (plus the end) such that no chunk accumulates more than ``max_log_decay`` of decay
    after its first token. ``max_decay[t]`` bounds ``-dt_t * A`` over all channels of token ``t``."""
    bounds = [0]
    acc, start = 0.0, 0
    for t in range(1, len(max_decay)):
        if t - start >= max_chunk or acc + max_decay[t] > max_log_decay:
            bounds.append(t)
            acc, start = 0.0, t
        else:
            acc += max_decay[t]
    bounds.append(len(max_decay))
    return bounds


def selective_scan_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    *,
    max_chunk: int = 32,
) -> torch.Tensor:
    """Chunked scan over ``L`` tokens; updates ``h`` in place to the state after the last token and
    returns ``y`` ``[Bs, L, D]`` (see :func:`selective_scan_at_`)."""
    return selective_scan_at_(x, dt, A, B, C, D, h, (), max_chunk=max_chunk)[0]


def selective_scan_at_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    at: CapturePoints,
    *,
    max_chunk: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selective_scan_`, also returning the states after the points of ``at`` (``(b, t)``: sequence
    ``b`` after its token ``t``): ``(y [Bs, L, D], [len(at), D, N])``.

    In a chunk starting at token 0, with ``a_t = dt_t * A`` and ``E_t = a_1 + ... + a_t`` (``E_0 = 0``):
    ``h_t = exp(E_t) * (exp(a_0) * h_in + sum_{k<=t} exp(-E_k) * dt_k x_k B_k)`` -- one cumulative sum
    instead of ``t`` dependent steps. Chunk lengths adapt so ``-E`` stays below ``MAX_LOG_DECAY``. The scan
    holds every ``h_t`` of a chunk, so a state at a point is a copy.
    """
    n_tokens = x.shape[1]
    h_at = h.new_empty(len(at), *h.shape[1:])
    if n_tokens == 1:
        y1 = selective_state_update_(h, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D).unsqueeze(1)
        for k, (b, _) in enumerate(at):
            h_at[k] = h[b]
        return y1, h_at
    max_decay = (dt * (-A).amax(-1)).amax(dim=(0, 2)).tolist()  # [L]
    bounds = chunk_bounds(max_decay, max_chunk)
    dtx = dt * x
    y = torch.empty_like(x)
    state = h
    for i, j in itertools.pairwise(bounds):
        dt0 = dt[:, i : i + 1]  # [Bs, 1, D]
        E_dt = cumsum_(dt[:, i:j].clone()).sub_(dt0)  # E_t / A: the dt summed over tokens 1..t
        eE = torch.exp_(E_dt.unsqueeze(-1) * A)  # [Bs, T, D, N]
        u = dtx[:, i:j, :, None] * B[:, i:j, None, :]  # [Bs, T, D, N]
        S = cumsum_(u.div_(eE))
        S.add_(state.unsqueeze(1) * torch.exp(dt0.unsqueeze(-1) * A)).mul_(eE)  # h_t for every t of the chunk
        y[:, i:j] = torch.matmul(S, C[:, i:j, :, None]).squeeze(-1)
        for k, (b, t) in enumerate(at):
            if i <= t < j:
                h_at[k] = S[b, t - i]
        state = S[:, -1]
    h.copy_(state)
    return torch.addcmul(y, D, x), h_at


def selective_states_at_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    at: CapturePoints,
) -> torch.Tensor:
    """Token-by-token twin of the states :func:`selective_scan_at_` returns at ``at``."""
    return states_at_ref(selective_state_step, x, dt, A, B, C, D, h, at)


def selective_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    *,
    max_chunk: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`selective_scan_` on a copy of ``h``; returns ``(y [Bs, L, D], h after the last token)``."""
    h = h.clone()
    return selective_scan_(x, dt, A, B, C, D, h, max_chunk=max_chunk), h
