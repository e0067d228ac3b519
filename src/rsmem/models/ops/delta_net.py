"""The gated delta rule (Qwen3.5's / Qwen3-Next's linear attention), in float32 (the chunked form sums its
log decays in float64).

One head's state is ``S`` ``[dv, dk]``, llama.cpp's layout (``dk`` fastest: element ``(j, i)`` is
transformers' ``recurrent_states[h, i, j]``). Per token, with ``q``, ``k`` L2-normalised (``q`` also scaled
by ``1/sqrt(dk)``), ``g`` the log decay and ``beta`` the write strength::

    S = exp(g) * S
    S = S + beta * (v - S k) k^T      (the delta rule: move S k towards v)
    o = S q

:func:`delta_rule_step` runs one token of many sequences, :func:`delta_rule_chunked` a prompt in chunks of
``chunk`` tokens (inside a chunk every token at once, in the WY form of transformers'
``torch_chunk_gated_delta_rule`` and llama.cpp's ``build_delta_net_chunking``; chunk after chunk for the
state), and :func:`delta_rule_ref` token by token (the twin the chunked form is checked against).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = [
    "delta_rule",
    "delta_rule_chunked",
    "delta_rule_ref",
    "delta_rule_step",
    "l2_norm",
    "unit_lower_inverse",
]

CHUNK = 64  # llama.cpp's and transformers' chunk size


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (llama.cpp's ``build_gdn_l2_norm``, transformers'
    ``l2norm``)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """One token of each of ``Bs`` sequences: ``q``, ``k`` ``[Bs, H, dk]``, ``v`` ``[Bs, H, dv]``, ``g``,
    ``beta`` ``[Bs, H]``; ``state`` ``[Bs, H, dv, dk]`` is updated in place. Returns ``o`` ``[Bs, H, dv]``."""
    state.mul_(g.exp()[..., None, None])
    kv = torch.matmul(state, k.unsqueeze(-1)).squeeze(-1)  # [Bs, H, dv]
    delta = (v - kv) * beta.unsqueeze(-1)
    state.add_(delta.unsqueeze(-1) * k.unsqueeze(-2))
    return torch.matmul(state, q.unsqueeze(-1)).squeeze(-1)


def delta_rule_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token by token: ``q``, ``k`` ``[Bs, L, H, dk]``, ``v`` ``[Bs, L, H, dv]``, ``g``, ``beta``
    ``[Bs, L, H]``, ``state`` ``[Bs, H, dv, dk]`` (not changed). Returns ``(o [Bs, L, H, dv], new state)``."""
    state = state.clone()
    outs = [delta_rule_step(q[:, t], k[:, t], v[:, t], g[:, t], beta[:, t], state) for t in range(q.shape[1])]
    return torch.stack(outs, dim=1), state


def unit_lower_inverse(a: torch.Tensor, block: int = 16) -> torch.Tensor:
    """``(I + a)^-1`` of strictly lower-triangular ``a`` ``[..., C, C]``: forward substitution inside the
    ``block``-sized diagonal blocks (all blocks of the batch at once), then diagonal blocks of ``s`` merged
    into blocks of ``2s`` (lower-left ``-T22 a21 T11``): whole batches of small matrices at once, far ahead of
    torch's batched ``solve_triangular``."""
    size = a.shape[-1]
    b = min(block, size)
    nb = -(-size // b)
    full = nb * b
    if full != size:  # zero rows and columns: identity rows of I + a, cut off at the end
        a = F.pad(a, (0, full - size, 0, full - size))
    lead = a.shape[:-2]
    diag = a.reshape(*lead, nb, b, nb, b).diagonal(dim1=-4, dim2=-2)  # [..., b, b, nb]
    t = -diag.permute(*range(len(lead)), -1, -3, -2).contiguous()  # [..., nb, b, b]
    for i in range(1, b):
        t[..., i, :i] += (t[..., i, :i, None] * t[..., :i, :i]).sum(-2)
    t += torch.eye(b, dtype=a.dtype, device=a.device)
    out = torch.zeros_like(a)
    for j in range(nb):
        out[..., j * b : (j + 1) * b, j * b : (j + 1) * b] = t[..., j, :, :]
    s = b
    while s < full:
        for lo in range(0, full - s, 2 * s):
            mid, hi = lo + s, min(lo + 2 * s, full)
            out[..., mid:hi, lo:mid] = -out[..., mid:hi, mid:hi] @ (
                a[..., mid:hi, lo:mid] @ out[..., lo:mid, lo:mid]
            )
        s *= 2
    return out[..., :size, :size]


def delta_rule_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int = CHUNK,
) -> torch.Tensor:
    """:func:`delta_rule_ref`'s result with the tokens of a chunk computed together; ``state`` is updated in
    place to the state after the last token. Returns ``o`` ``[Bs, L, H, dv]``.

    Per chunk (positions ``i``, ``j``; ``c`` the cumulative log decay inside the chunk): ``A[i, j] =
    beta_i (k_i . k_j) exp(c_i - c_j)`` for ``j < i``; ``T = (I + A)^-1`` (:func:`unit_lower_inverse`);
    ``u = T (beta v)``, ``w = T (beta exp(c) k)``; then, with ``S`` the state before the chunk,
    ``v' = u - w S^T``, ``o = exp(c) q S^T + (q k^T * exp(c_i - c_j), j <= i) v'`` and
    ``S = exp(c_last) S + v'^T (exp(c_last - c) k)``.

    ``c`` and the differences ``c_i - c_j``, ``c_last - c`` are summed in float64, then rounded to ``q``'s
    dtype for the exponentials: ``c_i - c_j`` of float32 sums loses the digits a strongly decaying head
    needs (a 64-token chunk with log decays to -8 a token: 1.1e-6 from float64's outputs, now 6e-8; the
    Qwen3.5 fixture's logits 1.5e-5 from llama.cpp's, as with all of it in float64)."""
    n_seqs, n_tokens, n_head, _ = k.shape
    dv = v.shape[-1]
    dtype = q.dtype
    size = max(1, min(chunk, n_tokens))
    pad = (-n_tokens) % size
    n_chunks = (n_tokens + pad) // size
    bh = n_seqs * n_head

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [Bs, L, H, ...] -> [n, Bs * H, C, ...], chunk-major
        if pad:
            t = torch.cat([t, t.new_zeros(n_seqs, pad, *t.shape[2:])], dim=1)
        t = t.reshape(n_seqs, n_chunks, size, n_head, *t.shape[3:]).transpose(2, 3).transpose(0, 1)
        return t.reshape(n_chunks, bh, size, *t.shape[4:])

    qc, kc, vc, bc = chunks(q), chunks(k), chunks(v), chunks(beta).unsqueeze(-1)
    gc = chunks(g.to(torch.float64)).cumsum(-1)  # [n, BH, C]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).to(dtype).masked_fill(~lower, float("-inf")).exp()
    g_exp = gc.to(dtype).exp().unsqueeze(-1)  # exp(c): [n, BH, C, 1]
    g_tail = (gc[..., -1:] - gc).to(dtype).exp().unsqueeze(-1)  # exp(c_last - c)
    g_last = gc[..., -1].to(dtype).exp()[..., None, None]  # exp(c_last): [n, BH, 1, 1]
    k_beta = kc * bc
    t_inv = unit_lower_inverse(((k_beta @ kc.transpose(-1, -2)) * decay).tril(-1))
    u = t_inv @ (vc * bc)  # [n, BH, C, dv]
    wq = torch.cat([t_inv @ (k_beta * g_exp), qc * g_exp], dim=-2)  # w, then exp(c) q: [n, BH, 2C, dk]
    qk = (qc @ kc.transpose(-1, -2)) * decay  # [n, BH, C, C]
    k_tail = (kc * g_tail).transpose(-1, -2).contiguous()  # [n, BH, dk, C]
    s_t = state.reshape(bh, dv, -1).transpose(-1, -2).to(dtype)  # [BH, dk, dv]
    out = q.new_empty(n_chunks, bh, size, dv)
    for c in range(n_chunks):
        ws = torch.bmm(wq[c], s_t)  # [BH, 2C, dv]: w S^T, exp(c) q S^T
        v_new = u[c] - ws[:, :size]
        torch.baddbmm(ws[:, size:], qk[c], v_new, out=out[c])
        s_t = torch.baddbmm(s_t * g_last[c], k_tail[c], v_new)
    state.copy_(s_t.transpose(-1, -2).reshape(state.shape))
    out = out.reshape(n_chunks, n_seqs, n_head, size, dv).permute(1, 0, 3, 2, 4)
    return out.reshape(n_seqs, n_chunks * size, n_head, dv)[:, :n_tokens]


def delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> torch.Tensor:
    """The micro-batch's outputs ``[Bs, L, H, dv]``, ``state`` updated in place: one token per sequence as a
    step of all sequences at once (:func:`delta_rule_step`), longer runs chunked
    (:func:`delta_rule_chunked`)."""
    if q.shape[1] == 1:
        return delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state).unsqueeze(1)
    return delta_rule_chunked(q, k, v, g, beta, state)
