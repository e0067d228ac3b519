"""A whole one-sequence RWKV-7 decode step as one function, for ``torch.compile`` (see
:mod:`rsmem.models.step.compiled`): every block and the head, matrices ``[out, in]`` as fused reductions
(:func:`~rsmem.models.step.fused.gemv`), the WKV update written elementwise so that inductor fuses it.

``rwkv7_token_one_(x, emb_norm, emb_norm_b, norm_f, norm_f_b, lm_head, eps, n_head, *flat)``: ``x`` the
token's embedding row ``[1, C]``; ``flat`` holds, per layer, the ``RWKV7_FIELDS`` tensors (the first
layer's unused ``v0, v1, v2`` may be any tensors of their shapes) followed by its token-shift rows
``[1, 2, C]`` and WKV state ``[1, H, N, N]``, both updated in place. Returns the logits ``[1, n_vocab]``.

``rwkv6_token_one_``: RWKV-6's step. Several sequences: :mod:`rsmem.models.step.wkv_many`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from rsmem.models.step.fused import SmallRows, gemv, matmul_rows
from rsmem.models.step.operands import RWKV6, RWKV7

N_PER_LAYER = RWKV7.n_fields  # RWKV7_FIELDS, then shift, wkv
GROUP_NORM_EPS = 64e-5
DECAY_SCALE = 0.606531


def one_row(x: torch.Tensor, weight: torch.Tensor | SmallRows) -> torch.Tensor:
    """A big matrix's product with one row ``x`` ``[1, in]``: through the C++ few-row kernel when ``weight``
    is a :class:`~rsmem.models.step.fused.SmallRows` (it streams the weights faster than inductor's
    reduction: it prefetches ahead and keeps the sums in registers), else
    as :func:`~rsmem.models.step.fused.gemv` (an ``[out, in]`` matrix, fused by inductor)."""
    return matmul_rows(x, weight) if isinstance(weight, SmallRows) else gemv(x, weight)


def _time_mix_one(
    x: torch.Tensor, prev: torch.Tensor, v_first: torch.Tensor | None, n_head: int, *t: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    (_, _, _, _, lerp, w0, w1, w2, a0, a1, a2, v0, v1, v2, g1, g2, k_k, k_a, r_k, wr, wk, wv, wo,
     ln_x, ln_x_b, _, _, _, _, wkv) = t  # fmt: skip
    c = x.shape[-1]
    n = c // n_head
    xr, xw, xk, xv, xa, xg = (x + (prev - x) * lerp.view(6, 1, c)).unbind(0)
    r = one_row(xr, wr)
    # the low-rank products as fused reductions too (as extern GEMM calls: ~100 calls a token)
    w = torch.exp(-DECAY_SCALE * torch.sigmoid(w0 + gemv(torch.tanh(gemv(xw, w1)), w2)))
    k = one_row(xk, wk)
    v = one_row(xv, wv)
    if v_first is None:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(v0 + gemv(gemv(xv, v1), v2))
    a = torch.sigmoid(a0 + gemv(gemv(xa, a1), a2))
    g = gemv(torch.sigmoid(gemv(xg, g1)), g2)
    kk = F.normalize((k * k_k).view(n_head, n), dim=-1, p=2.0, eps=1e-12)
    k = k * (1 + (a - 1) * k_a)
    rh, kh, vh, wh = r.view(n_head, n), k.view(n_head, n), v.view(n_head, n), w.view(n_head, n)
    b = kk * a.view(n_head, n)
    state = wkv[0]  # [H, V, K]
    sa = (state * (-kk).unsqueeze(-2)).sum(-1)  # [H, V]
    new = state * wh.unsqueeze(-2) + sa.unsqueeze(-1) * b.unsqueeze(-2) + vh.unsqueeze(-1) * kh.unsqueeze(-2)
    state.copy_(new)
    y = (new * rh.unsqueeze(-2)).sum(-1)  # [H, V]
    y = F.group_norm(y.reshape(1, c), n_head, ln_x, ln_x_b, GROUP_NORM_EPS).view(n_head, n)
    y = y + (rh * kh * r_k.view(n_head, n)).sum(-1, keepdim=True) * vh
    return one_row(y.reshape(1, c) * g, wo), v_first


def rwkv7_token_one_(
    x: torch.Tensor,
    emb_norm: torch.Tensor,
    emb_norm_b: torch.Tensor,
    norm_f: torch.Tensor,
    norm_f_b: torch.Tensor,
    lm_head: torch.Tensor,
    eps: float,
    n_head: int,
    *flat: torch.Tensor,
) -> torch.Tensor:
    c = x.shape[-1]
    x = F.layer_norm(x, (c,), emb_norm, emb_norm_b, eps)
    v_first: torch.Tensor | None = None
    for i in range(0, len(flat), N_PER_LAYER):
        t = flat[i : i + N_PER_LAYER]
        attn_norm, attn_norm_b, ffn_norm, ffn_norm_b = t[0], t[1], t[2], t[3]
        ffn_lerp_k, ffn_key, ffn_value, shift = t[-5], t[-4], t[-3], t[-2]
        h = F.layer_norm(x, (c,), attn_norm, attn_norm_b, eps)
        out, v_first = _time_mix_one(h, shift[:, 0], v_first, n_head, *t)
        x = x + out
        f = F.layer_norm(x, (c,), ffn_norm, ffn_norm_b, eps)
        kf = torch.relu(one_row(f + (shift[:, 1] - f) * ffn_lerp_k, ffn_key)).square()
        x = x + one_row(kf, ffn_value)
        shift[:, 0].copy_(h)
        shift[:, 1].copy_(f)
    return one_row(F.layer_norm(x, (c,), norm_f, norm_f_b, eps), lm_head)


# ---------------------------------------------------------------------------------------------- RWKV-6

N6_PER_LAYER = RWKV6.n_fields  # RWKV6_FIELDS, then shift, wkv


def _rwkv6_time_mix_one(x: torch.Tensor, prev: torch.Tensor, n_head: int, *t: torch.Tensor) -> torch.Tensor:
    (_, _, _, _, lerp_x, lerp, w1, w2, decay, decay_w1, decay_w2, u, wr, wk, wv, wg, wo, ln_x, ln_x_b,
     _, _, _, _, _, _, wkv) = t  # fmt: skip
    c = x.shape[-1]
    n = c // n_head
    sx = prev - x
    mixer = torch.tanh(gemv(x + sx * lerp_x, w1)).view(5, 1, -1)  # [5, 1, extra]; products: see RWKV-7's
    offsets = (w2 * mixer).sum(-1)  # [5, C]
    xw, xk, xv, xr, xg = (x + sx * (offsets + lerp)).unbind(0)
    r = one_row(xr.unsqueeze(0), wr).view(n_head, n)
    k = one_row(xk.unsqueeze(0), wk).view(n_head, n)
    v = one_row(xv.unsqueeze(0), wv).view(n_head, n)
    g = F.silu(one_row(xg.unsqueeze(0), wg))
    w = torch.exp(-torch.exp(decay + gemv(torch.tanh(gemv(xw, decay_w1)), decay_w2))).view(n_head, n)
    state = wkv[0]  # [H, K, V]
    y = (state * r.unsqueeze(-1)).sum(-2) + (r * u * k).sum(-1, keepdim=True) * v  # [H, V]
    state.copy_(state * w.unsqueeze(-1) + k.unsqueeze(-1) * v.unsqueeze(-2))
    y = F.group_norm(y.reshape(1, c), n_head, ln_x, ln_x_b, GROUP_NORM_EPS)
    return one_row(y * g, wo)


def rwkv6_token_one_(
    x: torch.Tensor,
    emb_norm: torch.Tensor,
    emb_norm_b: torch.Tensor,
    norm_f: torch.Tensor,
    norm_f_b: torch.Tensor,
    lm_head: torch.Tensor,
    eps: float,
    n_head: int,
    rescale_every: int,
    *flat: torch.Tensor,
) -> torch.Tensor:
    """:func:`rwkv7_token_one_` for RWKV-6 (per layer the ``RWKV6_FIELDS``, then shift and state),
    halving the residual after every ``rescale_every``-th layer (0: never)."""
    c = x.shape[-1]
    x = F.layer_norm(x, (c,), emb_norm, emb_norm_b, eps)
    for il, i in enumerate(range(0, len(flat), N6_PER_LAYER)):
        t = flat[i : i + N6_PER_LAYER]
        attn_norm, attn_norm_b, ffn_norm, ffn_norm_b = t[0], t[1], t[2], t[3]
        lerp_k, lerp_r, w_key, w_value, w_rec, shift = t[-7], t[-6], t[-5], t[-4], t[-3], t[-2]
        h = F.layer_norm(x, (c,), attn_norm, attn_norm_b, eps)
        x = x + _rwkv6_time_mix_one(h, shift[:, 0], n_head, *t)
        f = F.layer_norm(x, (c,), ffn_norm, ffn_norm_b, eps)
        sx = shift[:, 1] - f
        rf = torch.sigmoid(one_row(f + sx * lerp_r, w_rec))
        kf = torch.relu(one_row(f + sx * lerp_k, w_key)).square()
        x = x + rf * one_row(kf, w_value)
        if rescale_every and (il + 1) % rescale_every == 0:
            x = x * 0.5
        shift[:, 0].copy_(h)
        shift[:, 1].copy_(f)
    return one_row(F.layer_norm(x, (c,), norm_f, norm_f_b, eps), lm_head)
