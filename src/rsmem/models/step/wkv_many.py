"""A whole RWKV-7 or RWKV-6 decode step of several sequences (one token each) as one function, for
``torch.compile`` with a dynamic batch (see :mod:`rsmem.models.step.compiled`): every block and the head, the
big products through :func:`~rsmem.models.step.fused.matmul_rows` (the C++ few-row kernel up to 16
sequences, oneDNN's packed twins beyond, or those twins alone when the kernels are not built; one op called
from the compiled code), the low-rank mixers' products on the calling thread
(:mod:`~rsmem.models.ops.wkv_lowrank`), everything between them fused by inductor into one-thread kernels.

``rwkv7_token_many_(x, emb_norm, emb_norm_b, norm_f, norm_f_b, lm_head, eps, n_head, *flat)`` and
``rwkv6_token_many_(..., eps, n_head, rescale_every, *flat)`` take the arguments of the one-sequence steps of
:mod:`~rsmem.models.step.wkv_fused` (per layer its fields, then the token-shift rows ``[Bs, 2, C]`` and the
WKV state ``[Bs, H, N, N]``, both updated in place), with ``x`` ``[Bs, C]`` the tokens' embedding rows and
the big matrices (and ``lm_head``) as :func:`~rsmem.models.step.small_rows.rows_operand` gives them; they
return the logits ``[Bs, n_vocab]``. Before, the batched RWKV-7 step ran its products eagerly and three
compiled functions a layer between them (36 compiled calls a step, each paying dynamo's guards and Python's
dispatch); one call a step pays that once.

The state updates read each state once: both reductions use the old state and inductor fuses them with the
in-place store of the new one (see :mod:`rsmem.models.step.fused`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from rsmem.models.ops.wkv_lowrank import lowrank, matmul_one_thread
from rsmem.models.step.compiled import ONE_THREAD_GLUE
from rsmem.models.step.fused import matmul_rows
from rsmem.models.step.wkv_fused import DECAY_SCALE, GROUP_NORM_EPS, N6_PER_LAYER, N_PER_LAYER

# Inductor options of the several-sequence steps: every inductor kernel runs on one thread (a kernel goes
# parallel only when each thread's share is at least 2^24 elements at the batch it compiled with; inductor's
# default is 512), so the glue between the products and the WKV state updates run where they are, with no
# hand-off to a sleeping second thread; only the big products (matmul_rows) and nothing else use every thread
# (the low-rank ones run on one: ops.wkv_lowrank). Every kernel on the calling thread, with the one-thread
# low-rank products, removes most of a step's voluntary context switches (each a wait for the scheduler on a
# loaded machine) and costs no CPU time overall.
MANY_OPTIONS = ONE_THREAD_GLUE  # the one setting for "every inductor kernel on the calling thread"


def _rwkv7_wkv_many(
    xw: torch.Tensor,
    xv: torch.Tensor,
    xa: torch.Tensor,
    xg: torch.Tensor,
    r: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    v_first: torch.Tensor | None,
    wkv: torch.Tensor,
    *t: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RWKV-7's time mix between its input products and its output product: the mixes ``xw, xv, xa,
    xg`` and ``r, k, v`` ``[Bs, C]``, ``v_first`` the first layer's values (None in the first layer, whose
    own ``v`` it becomes), ``wkv`` ``[Bs, H, V, K]`` updated in place; ``t`` the layer's ``w0, w1, w2, a0,
    a1, a2, v0, v1, v2, g1, g2, k_k, k_a, r_k, ln_x, ln_x_b``. Returns the gated ``y`` ``[Bs, C]`` and
    ``v_first``."""
    w0, w1, w2, a0, a1, a2, v0, v1, v2, g1, g2, k_k, k_a, r_k, ln_x, ln_x_b = t
    n_seqs, n_head, n, _ = wkv.shape
    c = n_head * n
    w = torch.exp(-DECAY_SCALE * torch.sigmoid(w0 + lowrank(torch.tanh(lowrank(xw, w1)), w2)))
    if v_first is None:
        v_first = v
    else:
        v = v + (v_first - v) * torch.sigmoid(v0 + lowrank(lowrank(xv, v1), v2))
    a = torch.sigmoid(a0 + lowrank(lowrank(xa, a1), a2))
    g = lowrank(torch.sigmoid(lowrank(xg, g1)), g2)
    kk = F.normalize((k * k_k).view(n_seqs, n_head, n), dim=-1, p=2.0, eps=1e-12)
    k = k * (1 + (a - 1) * k_a)
    heads = (n_seqs, n_head, n)
    rh, kh, vh, wh = r.view(heads), k.view(heads), v.view(heads), w.view(heads)
    b = kk * a.view(heads)
    # both reductions read the old state (y = S (w r) + sa (b . r) + v (k . r)): the new one is not read
    # back, which saves a pass over every state
    sa = (wkv * (-kk).unsqueeze(-2)).sum(-1)  # [Bs, H, V]
    y = (wkv * (wh * rh).unsqueeze(-2)).sum(-1) + sa * (b * rh).sum(-1, keepdim=True)
    y = y + vh * (kh * rh).sum(-1, keepdim=True)
    new = wkv * wh.unsqueeze(-2) + sa.unsqueeze(-1) * b.unsqueeze(-2) + vh.unsqueeze(-1) * kh.unsqueeze(-2)
    wkv.copy_(new)
    y = F.group_norm(y.reshape(n_seqs, c), n_head, ln_x, ln_x_b, GROUP_NORM_EPS).view(heads)
    y = y + (rh * kh * r_k.view(n_head, n)).sum(-1, keepdim=True) * vh
    return y.reshape(n_seqs, c) * g, v_first


def _rwkv7_layer_many(
    x: torch.Tensor, v_first: torch.Tensor | None, eps: float, *t: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """One RWKV-7 block for one token of each sequence (``t``: the layer's ``RWKV7_FIELDS``, shift, wkv)."""
    (attn_norm, attn_norm_b, ffn_norm, ffn_norm_b, lerp, w0, w1, w2, a0, a1, a2, v0, v1, v2, g1, g2, k_k,
     k_a, r_k, wr, wk, wv, wo, ln_x, ln_x_b, ffn_lerp_k, ffn_key, ffn_value, shift, wkv) = t  # fmt: skip
    c = x.shape[-1]
    h = F.layer_norm(x, (c,), attn_norm, attn_norm_b, eps)
    sx = shift[:, 0] - h
    xr, xw, xk, xv, xa, xg = (h + sx * lerp[i] for i in range(6))
    r, k, v = matmul_rows(xr, wr), matmul_rows(xk, wk), matmul_rows(xv, wv)
    y, v_first = _rwkv7_wkv_many(
        xw, xv, xa, xg, r, k, v, v_first, wkv, w0, w1, w2, a0, a1, a2, v0, v1, v2, g1, g2, k_k, k_a, r_k,
        ln_x, ln_x_b,
    )  # fmt: skip
    x = x + matmul_rows(y, wo)
    f = F.layer_norm(x, (c,), ffn_norm, ffn_norm_b, eps)
    xk = f + (shift[:, 1] - f) * ffn_lerp_k
    shift[:, 0].copy_(h)
    shift[:, 1].copy_(f)
    kf = torch.relu(matmul_rows(xk, ffn_key)).square()
    return x + matmul_rows(kf, ffn_value), v_first


def rwkv7_token_many_(
    x: torch.Tensor,
    emb_norm: torch.Tensor,
    emb_norm_b: torch.Tensor,
    norm_f: torch.Tensor,
    norm_f_b: torch.Tensor,
    lm_head: Any,
    eps: float,
    n_head: int,
    *flat: Any,
) -> torch.Tensor:
    """One token of each of several RWKV-7 sequences (see the module): logits ``[Bs, n_vocab]``."""
    c = x.shape[-1]
    x = F.layer_norm(x, (c,), emb_norm, emb_norm_b, eps)
    v_first: torch.Tensor | None = None
    for i in range(0, len(flat), N_PER_LAYER):
        x, v_first = _rwkv7_layer_many(x, v_first, eps, *flat[i : i + N_PER_LAYER])
    return matmul_rows(F.layer_norm(x, (c,), norm_f, norm_f_b, eps), lm_head)


# ---------------------------------------------------------------------------------------------- RWKV-6


def _rwkv6_time_mix_many(x: torch.Tensor, prev: torch.Tensor, n_head: int, *t: Any) -> torch.Tensor:
    """RWKV-6's time mix for one token of each sequence: ``x``, ``prev`` ``[Bs, C]``; ``t`` the layer's
    ``RWKV6_FIELDS``, shift, wkv (``[Bs, H, K, V]``, updated in place)."""
    (_, _, _, _, lerp_x, lerp, w1, w2, decay, decay_w1, decay_w2, u, wr, wk, wv, wg, wo, ln_x, ln_x_b,
     _, _, _, _, _, _, wkv) = t  # fmt: skip
    n_seqs, c = x.shape
    n = c // n_head
    sx = prev - x
    mixer = torch.tanh(lowrank(x + sx * lerp_x, w1)).view(n_seqs, 5, -1)  # [Bs, 5, extra]
    offsets = matmul_one_thread(mixer.transpose(0, 1), w2.transpose(1, 2)).transpose(0, 1)  # [Bs, 5, C]
    xw, xk, xv, xr, xg = (x.unsqueeze(1) + sx.unsqueeze(1) * (offsets + lerp)).unbind(1)
    heads = (n_seqs, n_head, n)
    r = matmul_rows(xr, wr).view(heads)
    k = matmul_rows(xk, wk).view(heads)
    v = matmul_rows(xv, wv).view(heads)
    g = F.silu(matmul_rows(xg, wg))
    w = torch.exp(-torch.exp(decay + lowrank(torch.tanh(lowrank(xw, decay_w1)), decay_w2))).view(heads)
    # the output reads the old state (r^T S, then the bonus), fused with the in-place store of the new one
    y = (wkv * r.unsqueeze(-1)).sum(-2) + (r * u * k).sum(-1, keepdim=True) * v  # [Bs, H, V]
    wkv.copy_(wkv * w.unsqueeze(-1) + k.unsqueeze(-1) * v.unsqueeze(-2))
    y = F.group_norm(y.reshape(n_seqs, c), n_head, ln_x, ln_x_b, GROUP_NORM_EPS)
    return matmul_rows(y * g, wo)


def rwkv6_token_many_(
    x: torch.Tensor,
    emb_norm: torch.Tensor,
    emb_norm_b: torch.Tensor,
    norm_f: torch.Tensor,
    norm_f_b: torch.Tensor,
    lm_head: Any,
    eps: float,
    n_head: int,
    rescale_every: int,
    *flat: Any,
) -> torch.Tensor:
    """One token of each of several RWKV-6 sequences (see the module): logits ``[Bs, n_vocab]``."""
    c = x.shape[-1]
    x = F.layer_norm(x, (c,), emb_norm, emb_norm_b, eps)
    for il, i in enumerate(range(0, len(flat), N6_PER_LAYER)):
        t = flat[i : i + N6_PER_LAYER]
        attn_norm, attn_norm_b, ffn_norm, ffn_norm_b = t[0], t[1], t[2], t[3]
        lerp_k, lerp_r, w_key, w_value, w_rec, shift = t[-7], t[-6], t[-5], t[-4], t[-3], t[-2]
        h = F.layer_norm(x, (c,), attn_norm, attn_norm_b, eps)
        x = x + _rwkv6_time_mix_many(h, shift[:, 0], n_head, *t)
        f = F.layer_norm(x, (c,), ffn_norm, ffn_norm_b, eps)
        sx = shift[:, 1] - f
        rf = torch.sigmoid(matmul_rows(f + sx * lerp_r, w_rec))
        kf = torch.relu(matmul_rows(f + sx * lerp_k, w_key)).square()
        shift[:, 0].copy_(h)
        shift[:, 1].copy_(f)
        x = x + rf * matmul_rows(kf, w_value)
        if rescale_every and (il + 1) % rescale_every == 0:
            x = x * 0.5
    return matmul_rows(F.layer_norm(x, (c,), norm_f, norm_f_b, eps), lm_head)
