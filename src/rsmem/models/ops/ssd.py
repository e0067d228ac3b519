"""Mamba-2's scan (SSD): one scalar decay per head, so a chunk's outputs are a masked matrix product.

Shapes: ``x`` ``[Bs, L, H, P]``, ``dt`` ``[Bs, L, H]`` (after softplus), ``A`` ``[H]`` (``-exp(A_log)``),
``B``, ``C`` ``[Bs, L, G, N]`` (head ``h`` uses group ``h // (H // G)``), ``D`` ``[H]``, state ``h``
``[Bs, H, P, N]`` (llama.cpp's ggml ``[N, P, H]`` row).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rsmem.kernels.build import prompt_ops
from rsmem.models.ops.common import CapturePoints, scan_tokens, states_at_ref

# Sequences whose states are updated together in one decode step: about what one core's L2 cache holds.
STATE_BLOCK_BYTES = 1 << 20


def ssd_state_step(
    h: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token for every sequence: ``x`` ``[Bs, H, P]``, ``dt`` ``[Bs, H]``, ``B``, ``C`` ``[Bs, G, N]``."""
    rep = x.shape[1] // B.shape[1]
    Bh, Ch = B.repeat_interleave(rep, dim=1), C.repeat_interleave(rep, dim=1)  # [Bs, H, N]
    dA = torch.exp(dt * A)[:, :, None, None]  # [Bs, H, 1, 1]
    h = h * dA + (x * dt.unsqueeze(-1)).unsqueeze(-1) * Bh.unsqueeze(2)
    y = (h * Ch.unsqueeze(2)).sum(-1)
    return y + x * D.unsqueeze(-1), h


def ssd_state_update_(
    h: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
) -> torch.Tensor:
    """:func:`ssd_state_step` with ``h`` (contiguous) updated in place; returns ``y`` ``[Bs, H, P]``.

    The state is large (``H * P * N`` floats a sequence), so it is updated a cache-sized block of
    sequences at a time: decay, input and readout then touch each block once from memory, not three times.
    """
    n_seqs, n_head, head_dim = x.shape
    n_group, d_state = B.shape[1], B.shape[2]
    rows = n_head // n_group * head_dim  # state rows [P, N] of the heads sharing a group, stacked
    dA = torch.exp_(dt * A)[:, :, None, None]  # [Bs, H, 1, 1]
    xdt = (x * dt.unsqueeze(-1)).view(n_seqs, n_group, rows, 1)
    B, C = B.unsqueeze(2), C.unsqueeze(2)  # [Bs, G, 1, N]
    y = torch.empty(n_seqs, n_group, 1, rows, dtype=h.dtype)
    block = max(1, STATE_BLOCK_BYTES // max(1, h[0].nbytes))
    for i in range(0, n_seqs, block):
        j = min(i + block, n_seqs)
        hb = h[i:j].mul_(dA[i:j]).view(-1, rows, d_state)  # [(j-i) * G, rows, N]
        hb.addcmul_(xdt[i:j].view(-1, rows, 1), B[i:j].reshape(-1, 1, d_state))
        # y = h C, computed as C^T h^T: the faster product for these shapes
        torch.bmm(C[i:j].reshape(-1, 1, d_state), hb.transpose(1, 2), out=y[i:j].view(-1, 1, rows))
    return torch.addcmul(y.view(n_seqs, n_head, head_dim), x, D.unsqueeze(-1))


def ssd_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token-by-token twin of :func:`ssd_chunked`."""
    return scan_tokens(ssd_state_step, x, dt, A, B, C, D, h)


def ssd_chunked_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    *,
    chunk_size: int = 64,
) -> torch.Tensor:
    """The SSD chunked algorithm (Dao & Gu 2024, listing 1) from the state ``h``, which is updated in place
    to the state after the last token; returns ``y`` ``[Bs, L, H, P]`` (see :func:`ssd_chunked_at_`)."""
    return ssd_chunked_at_(x, dt, A, B, C, D, h, (), chunk_size=chunk_size)[0]


def ssd_chunked_at_(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    at: CapturePoints,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_chunked_`, also returning the states after the points of ``at`` (``(b, t)``: sequence
    ``b`` after its token ``t``): ``(y [Bs, L, H, P], [len(at), H, P, N])``.

    With the C++ kernels on (see :func:`rsmem.kernels.build.prompt_ops`), the scan runs token by token in C++
    as llama.cpp's ``ssm_scan`` does (``csrc/ssd_scan.cpp``: H * P * N multiply-adds a token, the state in
    cache, ahead of the chunked form at these models' shapes); otherwise, and as its twin's
    check, the chunked form below.

    Inside a chunk, outputs are ``(C B^T o L) (x dt)`` with ``L[l, s] = exp(sum_{s<k<=l} dt_k A)``; chunk
    boundary states are carried by a short loop over chunks (``L / chunk_size`` steps, not ``L``). A state
    inside a chunk is that chunk's start state decayed to the point plus the partial sum of the chunk's
    inputs up to it (:func:`_partial_state`): one chunk's worth of work per point, the grid unchanged.
    """
    n_seqs, n_tokens, n_head, head_dim = x.shape
    n_group, d_state = B.shape[2], B.shape[3]
    rep = n_head // n_group
    if n_tokens == 1:
        y1 = ssd_state_update_(h, x[:, 0], dt[:, 0], A, B[:, 0], C[:, 0], D).unsqueeze(1)
        return y1, torch.stack([h[b] for b, _ in at]) if at else h.new_empty(0, *h.shape[1:])
    ops = prompt_ops(n_tokens, x, dt, A, B, C, D, h) if h.is_contiguous() else None
    if ops is not None:
        at_b = torch.tensor([b for b, _ in at], dtype=torch.long)
        at_t = torch.tensor([t for _, t in at], dtype=torch.long)
        y, h_at = ops.ssd_scan_(x, dt, A, B, C, D, h, at_b, at_t)
        return y, h_at
    q = min(chunk_size, n_tokens)
    pad = (-n_tokens) % q
    nc = (n_tokens + pad) // q

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [Bs, L, ...] -> [Bs, nc, q, ...]; padding has dt = 0
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad)) if pad else t
        return t.reshape(n_seqs, nc, q, *t.shape[2:])

    xdt = chunks(x * dt.unsqueeze(-1)).view(n_seqs, nc, q, n_group, rep, head_dim)
    Bc, Cc = chunks(B), chunks(C)  # [Bs, nc, q, G, N]
    a = chunks(dt * A).view(n_seqs, nc, q, n_group, rep)
    acs = torch.cumsum(a, dim=2)  # [Bs, nc, q, G, R]

    # 1. inside each chunk: decay between positions l >= s, then the masked "attention" product
    seg = acs.permute(0, 1, 3, 4, 2)  # [Bs, nc, G, R, q]
    causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
    decay = torch.exp((seg.unsqueeze(-1) - seg.unsqueeze(-2)).masked_fill(~causal, float("-inf")))
    CB = torch.einsum("bclgn,bcsgn->bcgls", Cc, Bc).unsqueeze(3)  # [Bs, nc, G, 1, q, q]
    y = torch.einsum("bcgrls,bcsgrp->bclgrp", CB * decay, xdt)

    # 2. each chunk's own contribution to the state at its end
    to_end = torch.exp(acs[:, :, -1:] - acs)  # [Bs, nc, q, G, R]
    chunk_states = torch.einsum("bclgn,bclgrp->bcgrpn", Bc, xdt * to_end.unsqueeze(-1))

    # 3. states at chunk starts: a short recurrence over chunks
    chunk_decay = torch.exp(acs[:, :, -1])  # [Bs, nc, G, R]
    state = h.view(n_seqs, n_group, rep, head_dim, d_state)
    starts = []
    for c in range(nc):
        starts.append(state)
        state = torch.addcmul(chunk_states[:, c], state, chunk_decay[:, c, :, :, None, None])
    start_states = torch.stack(starts, dim=1)  # [Bs, nc, G, R, P, N]

    # the states at the points, before h is overwritten (starts[0] is a view of it)
    h_at = h.new_empty(len(at), *h.shape[1:])
    for i, (b, t) in enumerate(at):
        c, k = divmod(t, q)
        if k == q - 1:  # a chunk's end: the next chunk's start (or the final state)
            h_at[i] = (start_states[b, c + 1] if c + 1 < nc else state[b]).view(h_at.shape[1:])
        else:
            part = (acs[b, c, : k + 1], xdt[b, c, : k + 1], Bc[b, c, : k + 1])
            h_at[i] = _partial_state(start_states[b, c], *part).view(h_at.shape[1:])

    # 4. the start state's contribution to every position, decayed from the chunk start
    y_off = torch.einsum("bclgn,bcgrpn->bclgrp", Cc, start_states) * torch.exp(acs).unsqueeze(-1)
    y = (y + y_off).reshape(n_seqs, nc * q, n_head, head_dim)[:, :n_tokens]
    h.copy_(state.view(h.shape))
    return torch.addcmul(y, x, D.unsqueeze(-1)), h_at


def _partial_state(
    start: torch.Tensor, acs: torch.Tensor, xdt: torch.Tensor, B: torch.Tensor
) -> torch.Tensor:
    """One sequence's state after token ``l`` of a chunk from the chunk's ``start`` ``[G, R, P, N]`` and its
    tokens ``0..l``: ``acs`` ``[l+1, G, R]`` (cumulative ``dt A``), ``xdt`` ``[l+1, G, R, P]``, ``B``
    ``[l+1, G, N]`` -- the chunk-end formula of :func:`ssd_chunked_at_` with the end at ``l``."""
    to_l = torch.exp(acs[-1:] - acs)  # [l+1, G, R]
    part = torch.einsum("lgn,lgrp->grpn", B, xdt * to_l.unsqueeze(-1))
    return torch.addcmul(part, start, torch.exp(acs[-1])[:, :, None, None])


def ssd_states_at_ref(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    at: CapturePoints,
) -> torch.Tensor:
    """Token-by-token twin of the states :func:`ssd_chunked_at_` returns at ``at``."""
    return states_at_ref(ssd_state_step, x, dt, A, B, C, D, h, at)


def ssd_chunked(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    D: torch.Tensor,
    h: torch.Tensor,
    *,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`ssd_chunked_` on a copy of ``h``; returns ``(y [Bs, L, H, P], h after the last token)``."""
    h = h.clone()
    return ssd_chunked_(x, dt, A, B, C, D, h, chunk_size=chunk_size), h
