"""The gated delta rule (Qwen3.5's / Qwen3-Next's linear attention), computed in float32.

One head's state is ``S`` ``[dv, dk]``, llama.cpp's layout (``dk`` fastest: element ``(j, i)`` is
transformers' ``recurrent_states[h, i, j]``). Per token, with ``q``, ``k`` L2-normalised (``q`` also scaled
by ``1/sqrt(dk)``), ``g`` the log decay and ``beta`` the write strength::

    S = exp(g) * S
    S = S + beta * (v - S k) k^T      (the delta rule: move S k towards v)
    o = S q

:func:`delta_rule_step` runs one token of many sequences, :func:`delta_rule_chunked` a prompt in chunks of
``chunk`` tokens (inside a chunk every token at once, in the WY form of transformers'
``torch_chunk_gated_delta_rule`` and llama.cpp's ``build_delta_net_chunking``; chunk after chunk for the
state), and
:func:`delta_rule_ref` token by token (the reference the chunked form is checked against).
"""

from __future__ import annotations

import torch

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
    """``(I + a)^-1`` of strictly lower-triangular ``a`` ``[..., C, C]``: forward substitution inside
    ``block``-sized diagonal blocks (vectorised over the batch), then block forward substitution with
    matrix products. (torch's batched ``solve_triangular`` took 15x as long on 256 matrices of 64.)"""
    size = a.shape[-1]
    b = min(block, size)
    out = torch.zeros_like(a)
    for lo in range(0, size, b):
        hi = min(lo + b, size)
        t = -a[..., lo:hi, lo:hi]  # a copy: the rows below are rewritten
        for i in range(1, hi - lo):
            t[..., i, :i] = t[..., i, :i] + (t[..., i, :i, None] * t[..., :i, :i]).sum(-2)
        out[..., lo:hi, lo:hi] = t + torch.eye(hi - lo, dtype=a.dtype, device=a.device)
        if lo:  # rows lo..hi of the inverse left of the block: -T_ii sum_k L_ik T_kj
            out[..., lo:hi, :lo] = -out[..., lo:hi, lo:hi] @ (a[..., lo:hi, :lo] @ out[..., :lo, :lo])
    return out


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

    ``c`` and every decay factor are computed in float64 (then rounded to ``q``'s dtype): ``c_i - c_j`` of
    float32 sums loses the digits a strongly decaying head needs (on the Qwen3.5 fixture model the logits
    moved 2.2e-5 from the token-by-token form's; with the float64 decays 1e-6, as the whole computation
    in float64)."""
    n_seqs, n_tokens, n_head, _ = k.shape
    dv = v.shape[-1]
    dtype = q.dtype
    size = max(1, min(chunk, n_tokens))
    pad = (-n_tokens) % size
    n_chunks = (n_tokens + pad) // size

    def chunks(t: torch.Tensor) -> torch.Tensor:  # [Bs, L, H, ...] -> [Bs, H, n, C, ...]
        t = t.transpose(1, 2)
        if pad:
            t = torch.cat([t, t.new_zeros(*t.shape[:2], pad, *t.shape[3:])], dim=2)
        return t.reshape(n_seqs, n_head, n_chunks, size, *t.shape[3:])

    qc, kc, vc = chunks(q), chunks(k), chunks(v)
    gc, bc = chunks(g.to(torch.float64)).cumsum(-1), chunks(beta)  # [Bs, H, n, C]
    lower = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    decay = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~lower, float("-inf")).exp().to(dtype)
    g_exp = gc.exp().to(dtype).unsqueeze(-1)  # exp(c): [Bs, H, n, C, 1]
    g_tail = (gc[..., -1:] - gc).exp().to(dtype).unsqueeze(-1)  # exp(c_last - c)
    g_last = gc[..., -1].exp().to(dtype)[..., None, None]  # exp(c_last): [Bs, H, n, 1, 1]
    k_beta = kc * bc.unsqueeze(-1)
    t_inv = unit_lower_inverse(((k_beta @ kc.transpose(-1, -2)) * decay).tril(-1))
    u = t_inv @ (vc * bc.unsqueeze(-1))  # [Bs, H, n, C, dv]
    w = t_inv @ (k_beta * g_exp)  # [Bs, H, n, C, dk]
    qk = (qc @ kc.transpose(-1, -2)) * decay  # [Bs, H, n, C, C]
    q_decayed = qc * g_exp
    k_tail = (kc * g_tail).transpose(-1, -2)  # [Bs, H, n, dk, C]
    s_t = state.transpose(-1, -2).to(dtype)  # [Bs, H, dk, dv]
    out = q.new_empty(n_seqs, n_head, n_chunks, size, dv)
    for c in range(n_chunks):
        v_new = u[:, :, c] - w[:, :, c] @ s_t  # [Bs, H, C, dv]
        out[:, :, c] = q_decayed[:, :, c] @ s_t + qk[:, :, c] @ v_new
        s_t = s_t * g_last[:, :, c] + k_tail[:, :, c] @ v_new
    state.copy_(s_t.transpose(-1, -2))
    return out.reshape(n_seqs, n_head, n_chunks * size, dv)[:, :, :n_tokens].transpose(1, 2)


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
