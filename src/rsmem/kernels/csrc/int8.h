// Route 3 "int8": products of K-quant weights (Q4_K, Q5_K, Q6_K) with activations quantized to 8 bits per
// block of 256 values, as llama.cpp's Q8_K does (one float scale d = amax / 127, int8 values, sums of each
// 16 values), and integer dot products (AVX512-VNNI). A weight block is read as
//   w_i = d * sc_s * q_i - c_s        (s = i / 16 the sub-block of 16 values)
// with q_i unsigned (Q4_K 0..15, Q5_K 0..31, Q6_K 0..63), sc_s an integer scale (Q4_K / Q5_K: the 6-bit
// scale of its 32-value sub-block; Q6_K: the int8 scale) and c_s a float offset (Q4_K / Q5_K: dmin * min;
// Q6_K: 32 * d * sc_s). So one block's dot product with activations x_i = dx * a_i is
//   dx * d * sum_s sc_s * sum_{i in s} q_i a_i  -  sum_s c_s * dx * sum_{i in s} a_i
// the first sum in int32 (vpmaddubsw: u8 x s8 pairs to int16, exact here as |2 * 63 * 127| < 2^15;
// vpdpwssd: times the int16 scales into int32), the second from the activations' sums of 16.
// Chunks of 64 values: Q5_K chunk c holds sub-blocks 2c and 2c + 1 (the low and high nibbles of the same 32
// bytes); Q4_K's chunks pair them across 64 bytes instead (k4_at: activations stored in that order); Q6_K
// chunk c holds values 64c .. 64c + 63 in order (sub-blocks 4c .. 4c + 3).
// The scales and mins are unpacked in vector registers and d, dmin by F16C: a scalar unpacking writes four
// words and reads them back as one vector, a failed store forward that stalls every block.
#pragma once

#include "blocks.h"
#include "pool.h"

#if defined(RSMEM_AVX512) && defined(__AVX512VNNI__)
#define RSMEM_INT8 1

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>

namespace rsmem {
namespace i8 {

// One block of 256 activations: int8 values q, the same plus 128 as uint8 (qu, for products with signed
// weights), their sums of 16 and of 32 times d (float), and d. Quantized per 32 values instead (for Q8_0
// and Q4_0 weights, as llama.cpp's Q8_0 activations): q and qu, and d32 the scale of each 32 values; with
// `q4_order`, q holds each 64 values in Q4_0's nibble order, values [0, 16), [32, 48), [16, 32), [48, 64)
// (int8_small.h), qu in order.
struct alignas(64) ABlock {
  int8_t q[256];
  uint8_t qu[256];
  float bsum[16];
  float bsum32[8];
  float d32[8];
  float d;
};

// Where the j-th 16 activations of a block go in Q4_K's order (`k4_order`): each 128 values as sub-blocks of
// 32 [0, 2, 1, 3] (Int8<Q4_K>: one 64-byte load holds sub-blocks 0 and 2 as low nibbles, 1 and 3 as high).
constexpr int k4_at(int j) {
  constexpr int slot[4] = {0, 2, 1, 3};
  return 128 * (j / 8) + 32 * slot[(j / 2) % 4] + 16 * (j % 2);
}

// Quantize M rows of K float32 activations (K a multiple of 256) to ABlocks (llama.cpp's Q8_K: d = amax /
// 127, q = round(x / d), rounding to nearest even).
inline void quantize_rows(const float* x, int64_t M, int64_t K, ABlock* out, bool k4_order) {
  const int64_t nb = K / 256;
  pool::parallel_for(0, M * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const float* xb = x + b * 256;  // rows are contiguous: block b of the whole [M, K] array
      ABlock& o = out[b];
      __m512 amax = _mm512_setzero_ps();
      for (int i = 0; i < 256; i += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(xb + i)));
      const float a = _mm512_reduce_max_ps(amax);
      if (a == 0.f) {
        std::memset(o.q, 0, 256);
        std::memset(o.qu, 0x80, 256);
        for (int j = 0; j < 16; ++j) o.bsum[j] = 0.f;
        for (int j = 0; j < 8; ++j) o.bsum32[j] = 0.f;
        o.d = 0.f;
        continue;
      }
      const float iscale = 127.f / a, d = 1.f / iscale;
      const __m512 is = _mm512_set1_ps(iscale);
      alignas(64) int32_t sums[16];
      for (int j = 0; j < 16; ++j) {
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(xb + 16 * j), is));
        const __m128i q8 = _mm512_cvtsepi32_epi8(q);
        _mm_store_si128((__m128i*)(o.q + (k4_order ? k4_at(j) : 16 * j)), q8);
        _mm_store_si128((__m128i*)(o.qu + 16 * j), _mm_xor_si128(q8, _mm_set1_epi8(static_cast<char>(0x80))));
        sums[j] = _mm512_reduce_add_epi32(q);
      }
      const __m512 bs = _mm512_cvtepi32_ps(_mm512_load_si512(sums));
      _mm512_store_ps(o.bsum, _mm512_mul_ps(bs, _mm512_set1_ps(d)));
      for (int j = 0; j < 8; ++j) o.bsum32[j] = static_cast<float>(sums[2 * j] + sums[2 * j + 1]) * d;
      o.d = d;
    }
  });
}

// Quantize M rows of K float32 activations per 32 values (d32 = amax / 127 each) to q, qu and d32.
inline void quantize_rows_per32(const float* x, int64_t M, int64_t K, ABlock* out, bool q4_order) {
  const int64_t nb = K / 256;
  pool::parallel_for(0, M * nb, 64, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      ABlock& o = out[b];
      for (int j = 0; j < 8; ++j) {
        const float* xs = x + b * 256 + 32 * j;
        const __m512 x0 = _mm512_loadu_ps(xs), x1 = _mm512_loadu_ps(xs + 16);
        const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0), _mm512_abs_ps(x1)));
        const float iscale = a == 0.f ? 0.f : 127.f / a;
        o.d32[j] = a == 0.f ? 0.f : 1.f / iscale;
        const __m512 is = _mm512_set1_ps(iscale);
        const __m128i q0 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, is)));
        const __m128i q1 = _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, is)));
        const __m128i flip = _mm_set1_epi8(static_cast<char>(0x80));
        const int at0 = q4_order ? 64 * (j / 2) + 16 * (j % 2) : 32 * j, at1 = q4_order ? at0 + 32 : at0 + 16;
        _mm_store_si128((__m128i*)(o.q + at0), q0);
        _mm_store_si128((__m128i*)(o.q + at1), q1);
        _mm_store_si128((__m128i*)(o.qu + 32 * j), _mm_xor_si128(q0, flip));
        _mm_store_si128((__m128i*)(o.qu + 32 * j + 16), _mm_xor_si128(q1, flip));
      }
    }
  });
}

#define RSMEM_INLINE inline __attribute__((always_inline))

// int16 lane index vectors: lane l of chunk c takes integer scale kK4Idx[c][l] (Q4_K / Q5_K) or
// kQ6Idx[c][l] (Q6_K); kMinIdx: the min of each sub-block of 16 (lanes 8..15 of the decoded scales).
struct IdxTables {
  alignas(64) int16_t k4[4][32];
  alignas(64) int16_t k4o[4][32];
  alignas(64) int16_t q6[4][32];
  alignas(64) int32_t min16[16];
  constexpr IdxTables() : k4(), k4o(), q6(), min16() {
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        k4[c][l] = static_cast<int16_t>(2 * c + l / 16);
        k4o[c][l] = static_cast<int16_t>(4 * (c / 2) + c % 2 + 2 * (l / 16));
        q6[c][l] = static_cast<int16_t>(4 * c + l / 8);
      }
    for (int s = 0; s < 16; ++s) min16[s] = 8 + s / 2;
  }
};
alignas(64) inline constexpr IdxTables kIdx{};

// A weight block's constants: d, the 16 offsets c_s, and the integer scales as int16 lanes (zmm, 16 used).
struct WConst {
  float d;
  __m512 c;
  __m512i sc;
};

template <class T>
struct Int8;

// The eight 6-bit scales then the eight mins of a Q4_K / Q5_K block as 16 bytes (get_scale_min_k4).
RSMEM_INLINE __m128i k4_scale_min(const uint8_t* blk) {
  // the 12 scale bytes as 32-bit words u0, u1, u2 (the 4 bytes after them are the block's first values,
  // unused): v = [u0 & m6, (u2 & m4) | ((u0 >> 6) & 3) << 4, u1 & m6, ((u2 >> 4) & m4) | ((u1 >> 6) & 3) << 4]
  const __m128i u = _mm_loadu_si128((const __m128i*)(blk + 4));
  const __m128i low6 = _mm_and_si128(u, _mm_set1_epi8(0x3f));                                   // [v0, v2, .]
  const __m128i top2 = _mm_and_si128(_mm_srli_epi32(u, 6), _mm_set1_epi8(0x03));                // [h0, h1, .]
  const __m128i u2 = _mm_shuffle_epi32(u, 0xAA);
  const __m128i m4 = _mm_set1_epi8(0x0f);
  const __m128i nib = _mm_unpacklo_epi32(_mm_and_si128(u2, m4), _mm_and_si128(_mm_srli_epi32(u2, 4), m4));
  const __m128i odd = _mm_or_si128(nib, _mm_slli_epi32(top2, 4));                               // [v1, v3, .]
  return _mm_unpacklo_epi32(low6, odd);
}

RSMEM_INLINE void k4_const(const uint8_t* blk, WConst& w) {
  const __m128i sm = k4_scale_min(blk);
  int32_t d_dmin;
  std::memcpy(&d_dmin, blk, 4);
  const __m128 dd = _mm_cvtph_ps(_mm_cvtsi32_si128(d_dmin));  // d, dmin
  w.d = _mm_cvtss_f32(dd);
  w.sc = _mm512_castsi256_si512(_mm256_cvtepu8_epi16(sm));
  const __m512 all = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(sm));
  const __m512 mins = _mm512_permutexvar_ps(_mm512_load_si512(kIdx.min16), all);
  w.c = _mm512_mul_ps(mins, _mm512_broadcastss_ps(_mm_movehdup_ps(dd)));
}

// 32 bytes as 64 nibbles: the low nibbles in the low half, the high ones in the high half.
RSMEM_INLINE __m512i nibbles64(const uint8_t* p) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)p);
  const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
  return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
}

// Chunks in k4_at's order: chunk 2j holds the low nibbles of bytes [64j, 64j + 64) (sub-blocks 4j and
// 4j + 2), chunk 2j + 1 their high nibbles (4j + 1 and 4j + 3): one load and no lane crossing for two.
template <>
struct Int8<Q4_K> {
  static constexpr bool kK4Order = true;
  static RSMEM_INLINE void consts(const uint8_t* blk, WConst& w) { k4_const(blk, w); }
  template <int C>
  static RSMEM_INLINE __m512i chunk(const uint8_t* blk) {
    const __m512i b = _mm512_loadu_si512((const void*)(blk + 16 + 64 * (C / 2)));
    return _mm512_and_si512(C % 2 ? _mm512_srli_epi16(b, 4) : b, _mm512_set1_epi8(0x0F));
  }
  template <int C>
  static RSMEM_INLINE __m512i scales(const WConst& w) {
    return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx.k4o[C]), w.sc);
  }
  // values 64C .. 64C + 63 in order (route 4's panels, against activations in order)
  template <int C>
  static RSMEM_INLINE __m512i seq_chunk(const uint8_t* blk) {
    return nibbles64(blk + 16 + 32 * C);
  }
};

template <>
struct Int8<Q5_K> {
  static constexpr bool kK4Order = false;
  template <int C>
  static RSMEM_INLINE __m512i seq_chunk(const uint8_t* blk) {
    return chunk<C>(blk);
  }
  static RSMEM_INLINE void consts(const uint8_t* blk, WConst& w) { k4_const(blk, w); }
  template <int C>
  static RSMEM_INLINE __m512i chunk(const uint8_t* blk) {
    // fifth bits: bit 2C of qh[l] for the low half, bit 2C + 1 for the high half, moved to bit 4
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
    const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 1), 1);
    __m512i moved;
    if constexpr (2 * C <= 4) {
      moved = _mm512_slli_epi16(hz, 4 - 2 * C);
    } else {
      moved = _mm512_srli_epi16(hz, 2 * C - 4);
    }
    const __m512i hi = _mm512_and_si512(moved, _mm512_set1_epi8(0x10));
    return _mm512_or_si512(nibbles64(blk + 48 + 32 * C), hi);
  }
  template <int C>
  static RSMEM_INLINE __m512i scales(const WConst& w) {
    return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx.k4[C]), w.sc);
  }
};

template <>
struct Int8<Q6_K> {
  static constexpr bool kK4Order = false;
  template <int C>
  static RSMEM_INLINE __m512i seq_chunk(const uint8_t* blk) {
    return chunk<C>(blk);
  }
  static RSMEM_INLINE void consts(const uint8_t* blk, WConst& w) {
    const __m128i sc = _mm_loadu_si128((const __m128i*)(blk + 192));
    w.d = f16(blk + 208);
    w.sc = _mm512_castsi256_si512(_mm256_cvtepi8_epi16(sc));
    w.c = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc)), _mm512_set1_ps(32.f * w.d));
  }
  template <int C>
  static RSMEM_INLINE __m512i chunk(const uint8_t* blk) {
    constexpr int n = C >> 1, t = C & 1;
    const __m512i ql = _mm512_loadu_si512((const void*)(blk + 64 * n));
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
    const __m512i hz = _mm512_inserti64x4(_mm512_castsi256_si512(qh), _mm256_srli_epi16(qh, 2), 1);
    const __m512i lo = t ? _mm512_srli_epi16(ql, 4) : ql;
    const __m512i hi = t ? _mm512_srli_epi16(hz, 4) : hz;
    // (lo & 0x0F) | ((hi & 3) << 4) == (lo & 0x0F) | ((hi << 4) & 0x30): one ternary-logic select
    const __m512i v = _mm512_ternarylogic_epi32(_mm512_set1_epi8(0x0F), lo, _mm512_slli_epi16(hi, 4), 0xCA);
    return _mm512_and_si512(v, _mm512_set1_epi8(0x3F));
  }
  template <int C>
  static RSMEM_INLINE __m512i scales(const WConst& w) {
    return _mm512_permutexvar_epi16(_mm512_load_si512(kIdx.q6[C]), w.sc);
  }
};

// Chunk C of one block: isum[r][m] += the int16 scales times the u8 x s8 pair sums.
template <class T, int NR, int MR, int C>
RSMEM_INLINE void chunk_dot(const uint8_t* wb, int64_t ldw, const ABlock* ab, int64_t lda,
                            const WConst (&wc)[NR], __m512i (&isum)[NR][MR]) {
  __m512i xv[MR];
#pragma GCC unroll 16
  for (int m = 0; m < MR; ++m) xv[m] = _mm512_load_si512((const void*)(ab[m * lda].q + 64 * C));
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r) {
    const __m512i q = Int8<T>::template chunk<C>(wb + r * ldw);
    const __m512i s = Int8<T>::template scales<C>(wc[r]);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m)
      isum[r][m] = _mm512_dpwssd_epi32(isum[r][m], _mm512_maddubs_epi16(q, xv[m]), s);
  }
}

// y[m * ldy + r] for NR weight rows (stride ldw) and MR activation rows (stride lda blocks), nb blocks.
template <class T, int NR, int MR>
inline void tile(const uint8_t* w, int64_t ldw, int64_t nb, const ABlock* a, int64_t lda, float* y,
                 int64_t ldy, int64_t prefetch_rows) {
  using T8 = Int8<T>;
  __m512 acc[NR][MR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  const uint8_t* pf = w + prefetch_rows * ldw;
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (prefetch_rows)
      for (int off = 0; off < NR * T::TS; off += 64)
        _mm_prefetch((const char*)(pf + ib * NR * T::TS + off), _MM_HINT_T0);
    WConst wc[NR];
    __m512i isum[NR][MR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      T8::consts(w + r * ldw + ib * T::TS, wc[r]);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) isum[r][m] = _mm512_setzero_si512();
    }
    const ABlock* ab = a + ib;
    const uint8_t* wb = w + ib * T::TS;
    chunk_dot<T, NR, MR, 0>(wb, ldw, ab, lda, wc, isum);
    chunk_dot<T, NR, MR, 1>(wb, ldw, ab, lda, wc, isum);
    chunk_dot<T, NR, MR, 2>(wb, ldw, ab, lda, wc, isum);
    chunk_dot<T, NR, MR, 3>(wb, ldw, ab, lda, wc, isum);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const float dx = ab[m * lda].d;
      const __m512 bs = _mm512_load_ps(ab[m * lda].bsum);
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r][m]), _mm512_set1_ps(wc[r].d * dx), acc[r][m]);
        acc[r][m] = _mm512_fnmadd_ps(wc[r].c, bs, acc[r][m]);
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// Q8_0 / Q4_0's tile (int8_small.h), against activations quantized per 32 values.
template <class T, int NR, int MR>
void small_tile(const uint8_t* w, int64_t ldw, int64_t nb, const ABlock* a, int64_t lda, float* y,
                int64_t ldy, int64_t prefetch_rows);

// The tile of T's kind: the K-quants' (above) or Q8_0 / Q4_0's.
template <class T, int NR, int MR>
RSMEM_INLINE void any_tile(const uint8_t* w, int64_t ldw, int64_t nb, const ABlock* a, int64_t lda, float* y,
                           int64_t ldy, int64_t pf) {
  if constexpr (T::BS == 32) {
    small_tile<T, NR, MR>(w, ldw, nb, a, lda, y, ldy, pf);
  } else {
    tile<T, NR, MR>(w, ldw, nb, a, lda, y, ldy, pf);
  }
}

// All M activation rows against NR weight rows, in tiles of MR rows.
template <class T, int NR, int MR>
void rows_all_m(const uint8_t* w, int64_t ldw, int64_t nb, const ABlock* a, int64_t M, float* y, int64_t N,
                int64_t pf) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) any_tile<T, NR, MR>(w, ldw, nb, a + m * nb, nb, y + m * N, N, pf);
  const ABlock* am = a + m * nb;
  float* ym = y + m * N;
  switch (M - m) {
    case 3: any_tile<T, NR, 3>(w, ldw, nb, am, nb, ym, N, pf); break;
    case 2: any_tile<T, NR, 2>(w, ldw, nb, am, nb, ym, N, pf); break;
    case 1: any_tile<T, NR, 1>(w, ldw, nb, am, nb, ym, N, pf); break;
    default: break;
  }
}

template <class T, int NR, int MR>
void matmul_nr(const ABlock* a, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / 256, ldw = K / T::BS * T::TS;  // blocks of 256 activations; bytes a weight row
  const int64_t groups = (N + NR - 1) / NR;
  // at least kTaskBytes of weights (over M / 8) per task: see blocks.h
  const int64_t work = ldw * NR * std::max<int64_t>(1, M / 8);
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, work));
  // stream the weights ahead (6 groups: enough for the loads to overlap the sums; more gain nothing)
  const int64_t pf = M <= 8 ? 6 * NR : 0;
  pool::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NR;
      if (n0 + NR <= N) {
        rows_all_m<T, NR, MR>(w + n0 * ldw, ldw, nb, a, M, y + n0, N, g + 6 < g1 ? pf : 0);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_all_m<T, 1, MR>(w + n * ldw, ldw, nb, a, M, y + n, N, 0);
      }
    }
  });
}

// Whether route 3's tile for T reads activations in k4_at's order.
template <class T>
constexpr bool k4_order() {
  if constexpr (T::BS == 256) {
    return Int8<T>::kK4Order;
  } else {
    return false;
  }
}

// M rows of K activations quantized (quantize_rows, or per 32 values) into `buf`'s storage, 64-byte aligned.
inline ABlock* quantized(const float* x, int64_t M, int64_t K, at::Tensor& buf, bool per32 = false,
                         bool q4_order = false, bool k4_order = false) {
  buf = at::empty({static_cast<int64_t>(M * (K / 256) * sizeof(ABlock) + 64)}, at::kByte);
  const uintptr_t raw = reinterpret_cast<uintptr_t>(buf.data_ptr<uint8_t>());
  ABlock* a = reinterpret_cast<ABlock*>((raw + 63) & ~static_cast<uintptr_t>(63));
  if (per32) {
    quantize_rows_per32(x, M, K, a, q4_order);
  } else {
    quantize_rows(x, M, K, a, k4_order);
  }
  return a;
}

// y = x @ W^T with x quantized to 8 bits (once per product): per block of 256 for the K-quants, per 32
// values for Q8_0 / Q4_0 (K a multiple of 256).
template <class T>
void matmul(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  at::Tensor buf;
  const ABlock* a = quantized(x, M, K, buf, T::BS == 32, std::is_same_v<T, Q4_0>, k4_order<T>());
  if (M == 1) {
    // two weight rows at a time: streaming weights from memory, two rows a group keep more of the bandwidth
    // than four for Q6_K and Q8_0, and as much for Q4_K and Q5_K
    matmul_nr<T, 2, 1>(a, w, y, M, N, K);
  } else if (M == 2) {
    matmul_nr<T, 4, 2>(a, w, y, M, N, K);
  } else {
    matmul_nr<T, 2, 4>(a, w, y, M, N, K);
  }
}

}  // namespace i8
}  // namespace rsmem
#endif
