"""K-quant quantizers (Q2_K ... Q6_K), written from ggml-quants.c's reference functions
(``quantize_row_q{2,3,4,5,6}_K_ref`` with ``make_qkx2_quants`` / ``make_qx_quants`` / ``make_q3_quants`` /
``nearest_int``), the
ones llama.cpp's quantizer runs when no importance matrix is given.

Every step is float32 arithmetic in ggml's order, vectorised over blocks: sums that ggml accumulates element
by element are ``np.add.accumulate`` along the block (a sequential sum, unlike ``np.sum``'s pairwise one),
``a*b*c`` is ``(a*b)*c``, and ``nearest_int`` (ggml's 1.5*2^23 trick) is round-half-to-even. The bytes then
equal llama.cpp's (tests/quantize/ checks them against files llama.cpp wrote).

Each function takes float32 rows whose length is a multiple of 256 and returns the blocks as uint8, one row
of ``type_size`` bytes per 256 values.
"""

from __future__ import annotations

from collections.abc import Callable

import gguf
import numpy as np

Q = gguf.GGMLQuantizationType
QK_K = 256
GROUP_MAX_EPS = np.float32(1e-15)
F32 = np.float32


def _seq_sum(a: np.ndarray) -> np.ndarray:
    """Sum of ``a`` [n, groups] over its first axis, first to last element, in float32 (ggml's ``for``
    loop; numpy's ``sum`` is pairwise, and ``add.accumulate`` is exact but far slower than this loop)."""
    total = a[0].astype(np.float32, copy=True)
    for row in a[1:]:
        total += row
    return total


def _round_clip(v: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """``MAX(lo, MIN(hi, nearest_int(v)))`` as float32 (integers are exact in it)."""
    return np.clip(np.rint(v), F32(lo), F32(hi))


def _nearest_int(x: np.ndarray) -> np.ndarray:
    return np.rint(x).astype(np.int32)


def _f16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def _f16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(np.float16).astype(np.float32)


def make_qkx2_quants(
    x: np.ndarray, w: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int, use_mad: bool = False
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """ggml's ``make_qkx2_quants`` over groups ``x`` [n_groups, n] with weights ``w``: returns
    (scale, the_min, L) with L in [0, nmax]; ``use_mad`` weighs absolute errors instead of squared ones.
    Works on [n, n_groups] copies, so per-group values broadcast and sums run over rows."""

    def err(d: np.ndarray) -> np.ndarray:
        return np.abs(d) if use_mad else d * d

    x = np.ascontiguousarray(x.T)
    w = np.ascontiguousarray(w.T)
    mn = x.min(axis=0)
    mx = x.max(axis=0)
    sum_w = _seq_sum(w)
    sum_x = _seq_sum(w * x)
    mn = np.minimum(mn, F32(0))
    flat = mx == mn
    flat_min = -mn
    rng = np.where(flat, F32(1), mx - mn)
    iscale = F32(nmax) / rng
    scale = F32(1) / iscale
    L = _round_clip(iscale * (x - mn), 0, nmax)
    best_error = _seq_sum(w * err(scale * L + mn - x))
    with np.errstate(divide="ignore", invalid="ignore"):
        for step in range(nstep + 1):
            # ggml's loop reads ``min`` after the steps before it may have moved it
            iscale = (F32(rmin) + F32(rdelta) * F32(step) + F32(nmax)) / np.where(flat, F32(1), mx - mn)
            laux = _round_clip(iscale * (x - mn), 0, nmax)
            wl = w * laux
            sum_l = _seq_sum(wl)
            sum_l2 = _seq_sum(wl * laux)
            sum_xl = _seq_sum(wl * x)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_min = np.where(pos, F32(0), this_min)
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            cur_error = _seq_sum(w * err(this_scale * laux + this_min - x))
            better = (D > 0) & (cur_error < best_error)
            L = np.where(better, laux, L)
            best_error = np.where(better, cur_error, best_error)
            scale = np.where(better, this_scale, scale)
            mn = np.where(better, this_min, mn)
    L = np.where(flat, F32(0), L)
    scale = np.where(flat, F32(0), scale)
    return scale.astype(np.float32), np.where(flat, flat_min, -mn).astype(np.float32), L.T.astype(np.int32)


def make_qx_quants_rmse1(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_qx_quants`` with rmse_type 1 and no importance weights, over groups ``x``
    [n_groups, n]: returns (scale, L) with L in [0, 2*nmax)."""
    ax = np.abs(x)
    imax = ax.argmax(axis=1)  # the first of equal maxima, as ggml's strict ``>``
    amax = np.take_along_axis(ax, imax[:, None], axis=1)[:, 0]
    mx = np.take_along_axis(x, imax[:, None], axis=1)[:, 0]
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    xt = np.ascontiguousarray(x.T)
    w = xt * xt
    wx = w * xt

    def try_scale(iscale: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        lv = _round_clip(iscale * xt, -nmax, nmax - 1)
        return lv, _seq_sum(wx * lv), _seq_sum((w * lv) * lv)

    lv, sumlx, suml2 = try_scale(F32(-nmax) / mx)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, F32(0))
        best = scale * sumlx
        L = lv
        for step in range(-9, 10):
            if step == 0:
                continue
            lv, sumlx, suml2 = try_scale(-(F32(nmax) + F32(0.1) * F32(step)) / mx)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            L = np.where(better, lv, L)
            scale = np.where(better, sumlx / suml2, scale)
            best = np.where(better, scale * sumlx, best)
    L = np.where(zero[:, None], 0, L.T.astype(np.int32) + nmax)
    scale = np.where(zero, F32(0), scale)
    return scale.astype(np.float32), L


def _pack_scales_k4(ls: np.ndarray, lm: np.ndarray) -> np.ndarray:
    """The 12 scale bytes of a Q4_K/Q5_K block from 8 six-bit scales and mins ([nb, 8] each)."""
    ls = ls.astype(np.uint8)
    lm = lm.astype(np.uint8)
    out = np.zeros((ls.shape[0], 12), np.uint8)
    out[:, 0:4] = ls[:, 0:4] | ((ls[:, 4:8] >> 4) << 6)
    out[:, 4:8] = lm[:, 0:4] | ((lm[:, 4:8] >> 4) << 6)
    out[:, 8:12] = (ls[:, 4:8] & 0xF) | ((lm[:, 4:8] & 0xF) << 4)
    return out


def _q45k_common(
    x: np.ndarray, nmax: int, rmin: float, nstep: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The shared part of Q4_K and Q5_K: (d bytes + dmin bytes [nb, 4], scales [nb, 12], L [nb, 256])."""
    nb = x.shape[0] // QK_K
    sub = x.reshape(nb * 8, 32)
    sum_x2 = _seq_sum(np.ascontiguousarray((sub * sub).T))
    av_x = np.sqrt(sum_x2 / F32(32))
    weights = av_x[:, None] + np.abs(sub)
    scales, mins, L = make_qkx2_quants(sub, weights, nmax, rmin, 0.1, nstep)
    scales = scales.reshape(nb, 8)
    mins = mins.reshape(nb, 8)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, F32(63) / max_scale, F32(0))
        inv_min = np.where(max_min > 0, F32(63) / max_min, F32(0))
    ls = np.minimum(_nearest_int(inv_scale[:, None] * scales) & 0xFF, 63)  # ggml stores into a uint8
    lm = np.minimum(_nearest_int(inv_min[:, None] * mins) & 0xFF, 63)
    d16 = _f16_round(max_scale / F32(63))
    dmin16 = _f16_round(max_min / F32(63))
    d = (d16[:, None] * ls.astype(np.float32)).reshape(nb * 8)
    dm = (dmin16[:, None] * lm.astype(np.float32)).reshape(nb * 8)
    keep = d == 0  # ggml skips these sub-blocks, keeping make_qkx2_quants' L
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest_int((sub + dm[:, None]) / np.where(keep, F32(1), d)[:, None]), 0, nmax)
    L = np.where(keep[:, None], L, l2).reshape(nb, QK_K).astype(np.uint8)
    head = np.concatenate([_f16_bytes(d16), _f16_bytes(dmin16)], axis=1)
    return head, _pack_scales_k4(ls, lm), L


def quantize_q4_k(rows: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    head, scales, L = _q45k_common(x, 15, -1.0, 20)
    nb = L.shape[0]
    L4 = L.reshape(nb, 4, 2, 32)
    qs = (L4[:, :, 0, :] | (L4[:, :, 1, :] << 4)).reshape(nb, 128)
    return np.concatenate([head, scales, qs], axis=1)


def quantize_q5_k(rows: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    head, scales, L = _q45k_common(x, 31, -0.5, 15)
    nb = L.shape[0]
    L4 = L.reshape(nb, 4, 2, 32)  # [block, n/64, half, j]
    hi = (L4 > 15).astype(np.uint8)
    lo = L4 - hi * 16
    shifts = (2 * np.arange(4, dtype=np.uint8))[None, :, None]
    qh = ((hi[:, :, 0, :] << shifts) | (hi[:, :, 1, :] << (shifts + 1))).sum(axis=1, dtype=np.uint8)
    qs = (lo[:, :, 0, :] | (lo[:, :, 1, :] << 4)).reshape(nb, 128)
    return np.concatenate([head, scales, qh, qs], axis=1)


def quantize_q6_k(rows: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    nb = x.shape[0] // QK_K
    sub = x.reshape(nb * 16, 16)
    scales, L = make_qx_quants_rmse1(sub, 32)
    scales = scales.reshape(nb, 16)
    ia = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, ia[:, None], axis=1)[:, 0]
    zero = np.abs(max_scale) < GROUP_MAX_EPS
    with np.errstate(divide="ignore"):
        iscale = F32(-128) / np.where(zero, F32(1), max_scale)
        d16 = np.where(zero, F32(0), _f16_round(F32(1) / iscale))
    sc = np.minimum(_nearest_int(iscale[:, None] * scales), 127).astype(np.int8)
    d = (d16[:, None] * sc.astype(np.float32)).reshape(nb * 16)
    keep = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest_int(sub / np.where(keep, F32(1), d)[:, None]), -32, 31) + 32
    L = np.where(keep[:, None], L, l2).reshape(nb, QK_K).astype(np.uint8)
    L = np.where(zero[:, None], np.uint8(0), L)
    sc = np.where(zero[:, None], np.int8(0), sc)
    L8 = L.reshape(nb, 2, 4, 32)  # [block, 128-half, quarter, l]
    low = L8 & 0xF
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    high = L8 >> 4
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    return np.concatenate(
        [ql.reshape(nb, 128), qh.reshape(nb, 64), sc.view(np.uint8), _f16_bytes(d16)], axis=1
    )


def make_q3_quants(x: np.ndarray, nmax: int) -> tuple[np.ndarray, np.ndarray]:
    """ggml's ``make_q3_quants`` with do_rmse over groups ``x`` [n_groups, n]: returns (scale, L) with
    L in [0, 2*nmax) (0 for an all-zero group). The element-by-element refinement is sequential within a
    group, so it loops over elements, vectorised over groups; a group whose pass changed nothing would
    change nothing in the next, so every group runs the 5 passes."""
    ax = np.abs(x)
    imax = ax.argmax(axis=1)
    amax = np.take_along_axis(ax, imax[:, None], axis=1)[:, 0]
    mx = np.take_along_axis(x, imax[:, None], axis=1)[:, 0]
    zero = amax < GROUP_MAX_EPS
    mx = np.where(zero, F32(1), mx)
    xt = np.ascontiguousarray(x.T)
    L = _round_clip((F32(-nmax) / mx) * xt, -nmax, nmax - 1)
    w = xt * xt
    wx = w * xt
    sumlx = _seq_sum(wx * L)
    suml2 = _seq_sum((w * L) * L)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        for _ in range(5):
            for i in range(xt.shape[0]):
                li = L[i]
                slx = sumlx - wx[i] * li
                sl2 = suml2 - (w[i] * li) * li
                new_l = _round_clip(np.where(slx > 0, (xt[i] * sl2) / slx, F32(0)), -nmax, nmax - 1)
                slx2 = slx + wx[i] * new_l
                sl22 = sl2 + (w[i] * new_l) * new_l
                take = (
                    (slx > 0) & (new_l != li) & (sl22 > 0) & ((slx2 * slx2) * suml2 > (sumlx * sumlx) * sl22)
                )
                L[i] = np.where(take, new_l, li)
                sumlx = np.where(take, slx2, sumlx)
                suml2 = np.where(take, sl22, suml2)
        scale = np.where(suml2 > 0, sumlx / suml2, F32(0))
    L = np.where(zero[:, None], 0, L.T.astype(np.int32) + nmax)
    return np.where(zero, F32(0), scale).astype(np.float32), L


def _pack_2bit(L: np.ndarray) -> np.ndarray:
    """ggml's 2-bit layout of Q2_K/Q3_K: byte l of each 128-value half holds values l, l+32, l+64, l+96."""
    nb = L.shape[0]
    L4 = L.reshape(nb, 2, 4, 32).astype(np.uint8)
    return (L4[:, :, 0] | (L4[:, :, 1] << 2) | (L4[:, :, 2] << 4) | (L4[:, :, 3] << 6)).reshape(nb, 64)


def quantize_q2_k(rows: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    nb = x.shape[0] // QK_K
    sub = x.reshape(nb * 16, 16)
    scales, mins, L = make_qkx2_quants(sub, np.abs(sub), 3, -0.5, 0.1, 15, use_mad=True)
    scales = scales.reshape(nb, 16)
    mins = mins.reshape(nb, 16)
    max_scale = np.maximum(scales.max(axis=1), F32(0))
    max_min = np.maximum(mins.max(axis=1), F32(0))
    q4 = F32(15)
    has_s, has_m = max_scale > 0, max_min > 0
    ls = np.where(
        has_s[:, None], _nearest_int((q4 / np.where(has_s, max_scale, F32(1)))[:, None] * scales), 0
    )
    lm = np.where(has_m[:, None], _nearest_int((q4 / np.where(has_m, max_min, F32(1)))[:, None] * mins), 0)
    packed = ((ls & 0xFF) | (lm << 4)) & 0xFF  # ggml stores l into a uint8, then ors the min's bits above
    d16 = np.where(has_s, _f16_round(max_scale / q4), F32(0))
    dmin16 = np.where(has_m, _f16_round(max_min / q4), F32(0))
    d = (d16[:, None] * (packed & 0xF).astype(np.float32)).reshape(-1)
    dm = (dmin16[:, None] * (packed >> 4).astype(np.float32)).reshape(-1)
    keep = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest_int((sub + dm[:, None]) / np.where(keep, F32(1), d)[:, None]), 0, 3)
    L = np.where(keep[:, None], L, l2).reshape(nb, QK_K)
    return np.concatenate(
        [packed.astype(np.uint8), _pack_2bit(L), _f16_bytes(d16), _f16_bytes(dmin16)], axis=1
    )


def quantize_q3_k(rows: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(rows, dtype=np.float32).reshape(-1)
    nb = x.shape[0] // QK_K
    sub = x.reshape(nb * 16, 16)
    scales, L = make_q3_quants(sub, 4)
    scales = scales.reshape(nb, 16)
    ia = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, ia[:, None], axis=1)[:, 0]
    has = max_scale != 0
    with np.errstate(divide="ignore"):
        iscale = F32(-32) / np.where(has, max_scale, F32(1))
    lq = np.where(has[:, None], np.clip(_nearest_int(iscale[:, None] * scales), -32, 31) + 32, 0)
    sc = np.zeros((nb, 12), np.uint8)
    low = (lq & 0xF).astype(np.uint8)
    sc[:, 0:8] = low[:, 0:8] | (low[:, 8:16] << 4)
    high = (lq >> 4).astype(np.uint8).reshape(nb, 4, 4)  # [j // 4, j % 4]
    sc[:, 8:12] = high[:, 0] | (high[:, 1] << 2) | (high[:, 2] << 4) | (high[:, 3] << 6)
    d16 = np.where(has, _f16_round(F32(1) / iscale), F32(0))
    d = (d16[:, None] * (lq - 32).astype(np.float32)).reshape(-1)
    keep = d == 0
    with np.errstate(divide="ignore", invalid="ignore"):
        l2 = np.clip(_nearest_int(sub / np.where(keep, F32(1), d)[:, None]), -4, 3) + 4
    L = np.where(keep[:, None], L, l2).reshape(nb, QK_K)
    hi = (L > 3).astype(np.uint8).reshape(nb, 8, 32)  # bit j // 32 of hmask byte j % 32
    hmask = (hi << np.arange(8, dtype=np.uint8)[None, :, None]).sum(axis=1, dtype=np.uint8)
    return np.concatenate([hmask, _pack_2bit(L - 4 * (L > 3)), sc, _f16_bytes(d16)], axis=1)


QUANTIZERS: dict[gguf.GGMLQuantizationType, Callable[[np.ndarray], np.ndarray]] = {
    Q.Q2_K: quantize_q2_k,
    Q.Q3_K: quantize_q3_k,
    Q.Q4_K: quantize_q4_k,
    Q.Q5_K: quantize_q5_k,
    Q.Q6_K: quantize_q6_k,
}
