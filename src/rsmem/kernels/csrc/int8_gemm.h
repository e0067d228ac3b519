// Route 4 "int8 panels": the int8 route's arithmetic (int8.h: activations as llama.cpp's Q8_K, the blocks'
// own integers) for many activation rows. Each task repacks 16 weight rows at a time ("panel") into
//   w[g][r]  the 4 values 4g .. 4g + 3 of row r (one int32 lane per row: a zmm holds 16 rows)
// with their scales as per-row vectors, once per product; then every activation row m multiplies the panel
// with vpdpbusd against 4 broadcast activation bytes (16 rows x 4 values a instruction, no unpacking in
// the loop). Sums run per sub-block (Q4_K / Q5_K: 32 values; Q6_K: 16) in int32, then times d * sc in
// float. Q6_K's q - 32 is signed: it takes the activations as uint8 (q + 128), and each sub-block's sum
// starts at -128 * (sum of its weights), so the integer sums equal route 3's.
// Q8_0 and Q4_0 (q - 8) weights, signed too, go the same way against activations quantized per 32 values
// (llama.cpp's Q8_0 activations): a sub-block is one weight block, its sum times the weights' scale and
// the activations' scale of those 32 values.
#pragma once

#include "int8.h"

#ifdef RSMEM_INT8
#include <vector>

namespace rsmem {
namespace i8 {

constexpr int kPanel = 16;

// One block (256 values) of one panel.
struct alignas(64) PanelBlock {
  int32_t w[64][kPanel];      // 4 bytes of weights per row and group of 4 values
  float scf[16][kPanel];      // d * sc per sub-block (Q4_K / Q5_K: 8 of 32 values; Q6_K: 16 of 16)
  float mnf[8][kPanel];       // Q4_K / Q5_K: dmin * min per sub-block of 32
  int32_t init[16][kPanel];   // Q6_K: -128 * the sum of the sub-block's q - 32
};

// A 16 x 16 matrix of int32 (r[i]: row i) transposed in place (r[j]: column j).
inline void transpose16(__m512i (&r)[16]) {
  __m512i t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
  }
  // r[4i + j], 128-bit lane L: rows 4i .. 4i + 3 of column 4L + j
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
    r[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
    r[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
  }
  for (int j = 0; j < 4; ++j) {
    const __m512i ab_lo = _mm512_shuffle_i32x4(r[j], r[4 + j], 0x44);
    const __m512i ab_hi = _mm512_shuffle_i32x4(r[j], r[4 + j], 0xEE);
    const __m512i cd_lo = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0x44);
    const __m512i cd_hi = _mm512_shuffle_i32x4(r[8 + j], r[12 + j], 0xEE);
    t[j] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0x88);       // column j
    t[4 + j] = _mm512_shuffle_i32x4(ab_lo, cd_lo, 0xDD);   // column 4 + j
    t[8 + j] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0x88);   // column 8 + j
    t[12 + j] = _mm512_shuffle_i32x4(ab_hi, cd_hi, 0xDD);  // column 12 + j
  }
  for (int i = 0; i < 16; ++i) r[i] = t[i];
}

// 64 values of Q8_0 / Q4_0 (two blocks from `blk`) as int8, and their two scales.
template <class T>
RSMEM_INLINE __m512i small_chunk(const uint8_t* blk, float& d0, float& d1) {
  d0 = f16(blk);
  d1 = f16(blk + T::TS);
  if constexpr (std::is_same_v<T, Q8_0>) {
    const __m256i b0 = _mm256_loadu_si256((const __m256i*)(blk + 2));
    const __m256i b1 = _mm256_loadu_si256((const __m256i*)(blk + T::TS + 2));
    return _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1);
  } else {
    // Q4_0: value i < 16 the low nibble of byte i, 16 + i the high one; q - 8
    const __m128i b0 = _mm_loadu_si128((const __m128i*)(blk + 2));
    const __m128i b1 = _mm_loadu_si128((const __m128i*)(blk + T::TS + 2));
    const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    // [lo0, lo1, hi0, hi1] -> [lo0, hi0, lo1, hi1]
    const __m512i ordered = _mm512_shuffle_i32x4(z, z, 0xD8);
    return _mm512_sub_epi8(_mm512_and_si512(ordered, _mm512_set1_epi8(0x0F)), _mm512_set1_epi8(8));
  }
}

template <class T>
struct Panel {
  // Q8_0 / Q4_0: blocks of 32 values, each with its own float scale, against activations quantized per 32
  static constexpr bool kSmall = T::BS == 32;
  // weights as int8 (Q6_K: q - 32; Q8_0; Q4_0: q - 8), activations + 128
  static constexpr bool kSigned = std::is_same_v<T, Q6_K> || kSmall;
  static constexpr int kSub = std::is_same_v<T, Q6_K> ? 16 : 8;  // sub-blocks a block of 256
  static constexpr int kGroups = 256 / kSub / 4;                 // groups of 4 values a sub-block
  static constexpr int64_t kBytes = 256 / T::BS * T::TS;        // bytes of 256 values

  // Block ib of rows [0, rows) (at most kPanel; the rest zero) of `w` (stride ldw) into p.
  static void pack(const uint8_t* w, int64_t ldw, int rows, int64_t ib, PanelBlock& p) {
    __m512i c[4][kPanel];  // chunk j of row r: 64 values, 16 groups of 4
    for (int r = 0; r < kPanel; ++r) {
      if (r >= rows) {
        for (int j = 0; j < 4; ++j) c[j][r] = _mm512_setzero_si512();
        for (int s = 0; s < 16; ++s) p.scf[s][r] = 0.f, p.init[s][r] = 0;
        for (int s = 0; s < 8; ++s) p.mnf[s][r] = 0.f;
        continue;
      }
      const uint8_t* blk = w + r * ldw + ib * kBytes;
      if constexpr (kSmall) {
        for (int j = 0; j < 4; ++j) {
          c[j][r] = small_chunk<T>(blk + 2 * j * T::TS, p.scf[2 * j][r], p.scf[2 * j + 1][r]);
          alignas(64) uint64_t e[8];  // sums of 8 values + 128 each
          const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
          const __m512i biased = _mm512_xor_si512(c[j][r], flip);
          _mm512_store_si512((void*)e, _mm512_sad_epu8(biased, _mm512_setzero_si512()));
          for (int t = 0; t < 2; ++t) {
            const uint64_t biased_sum = e[4 * t] + e[4 * t + 1] + e[4 * t + 2] + e[4 * t + 3];
            const int64_t sum = static_cast<int64_t>(biased_sum) - 128 * 32;
            p.init[2 * j + t][r] = static_cast<int32_t>(-128 * sum);
          }
        }
      } else {
        c[0][r] = Int8<T>::template seq_chunk<0>(blk);
        c[1][r] = Int8<T>::template seq_chunk<1>(blk);
        c[2][r] = Int8<T>::template seq_chunk<2>(blk);
        c[3][r] = Int8<T>::template seq_chunk<3>(blk);
        Scales sc;
        T::scales(blk, sc);
        for (int s = 0; s < kSub; ++s) p.scf[s][r] = sc.a[s];
        if constexpr (kSigned) {
          // sums of 16 values of q (sums of 8 bytes, vpsadbw), then of q - 32: -128 x that starts each sum
          for (int j = 0; j < 4; ++j) {
            alignas(64) uint64_t e[8];
            _mm512_store_si512((void*)e, _mm512_sad_epu8(c[j][r], _mm512_setzero_si512()));
            for (int t = 0; t < 4; ++t)
              p.init[4 * j + t][r] = -128 * (static_cast<int32_t>(e[2 * t] + e[2 * t + 1]) - 512);
            c[j][r] = _mm512_sub_epi8(c[j][r], _mm512_set1_epi8(32));
          }
        } else {
          for (int s = 0; s < 8; ++s) p.mnf[s][r] = sc.b[s];
        }
      }
    }
    for (int j = 0; j < 4; ++j) {
      transpose16(c[j]);
      for (int g = 0; g < 16; ++g) _mm512_store_si512((void*)p.w[16 * j + g], c[j][g]);
    }
  }
};

// y[m * ldy + 16 v + r] for NV panels (p[v]: nb blocks each) and MR activation rows (stride lda blocks).
template <class T, int NV, int MR>
void panel_tile(const PanelBlock* const (&p)[NV], int64_t nb, const ABlock* a, int64_t lda, float* y,
                int64_t ldy, int valid) {
  using P = Panel<T>;
  __m512 total[NV][MR];
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) total[v][m] = _mm512_setzero_ps();
  for (int64_t ib = 0; ib < nb; ++ib) {
    __m512 fblk[NV][MR];
#pragma GCC unroll 16
    for (int v = 0; v < NV; ++v)
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) fblk[v][m] = _mm512_setzero_ps();
    for (int s = 0; s < P::kSub; ++s) {
      __m512i isum[NV][MR];
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const __m512i init = P::kSigned ? _mm512_load_si512(p[v][ib].init[s]) : _mm512_setzero_si512();
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) isum[v][m] = init;
      }
#pragma GCC unroll 8
      for (int g = 0; g < P::kGroups; ++g) {
        const int gi = s * P::kGroups + g;
        __m512i xb[MR];
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const ABlock& ab = a[m * lda + ib];
          const uint8_t* src = P::kSigned ? ab.qu : reinterpret_cast<const uint8_t*>(ab.q);
          xb[m] = _mm512_set1_epi32(*reinterpret_cast<const int32_t*>(src + 4 * gi));
        }
#pragma GCC unroll 16
        for (int v = 0; v < NV; ++v) {
          const __m512i wv = _mm512_load_si512(p[v][ib].w[gi]);
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m)
            isum[v][m] = P::kSigned ? _mm512_dpbusd_epi32(isum[v][m], xb[m], wv)
                                    : _mm512_dpbusd_epi32(isum[v][m], wv, xb[m]);
        }
      }
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) {
        const __m512 scf = _mm512_load_ps(p[v][ib].scf[s]);
        if constexpr (P::kSmall) {  // the weights' scale times the activations' of these 32 values
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m) {
            const __m512 sd = _mm512_mul_ps(scf, _mm512_set1_ps(a[m * lda + ib].d32[s]));
            total[v][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[v][m]), sd, total[v][m]);
          }
          continue;
        }
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m)
          fblk[v][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[v][m]), scf, fblk[v][m]);
        if constexpr (!P::kSigned) {
          const __m512 mn = _mm512_load_ps(p[v][ib].mnf[s]);
#pragma GCC unroll 16
          for (int m = 0; m < MR; ++m)
            total[v][m] = _mm512_fnmadd_ps(mn, _mm512_set1_ps(a[m * lda + ib].bsum32[s]), total[v][m]);
        }
      }
    }
    if constexpr (P::kSmall) continue;
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) {
      const __m512 dx = _mm512_set1_ps(a[m * lda + ib].d);
#pragma GCC unroll 16
      for (int v = 0; v < NV; ++v) total[v][m] = _mm512_fmadd_ps(fblk[v][m], dx, total[v][m]);
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < NV; ++v) {
    const int left = valid - kPanel * v;
    if (left <= 0) break;
    const __mmask16 mask = left >= kPanel ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1);
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) _mm512_mask_storeu_ps(y + m * ldy + kPanel * v, mask, total[v][m]);
  }
}

// y = x @ W^T for many rows: tasks of NV panels (16 NV weight rows) packed once, then every activation row.
template <class T>
void matmul_panels(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int NV = 2, MR = 4;
  at::Tensor buf;
  const ABlock* a = quantized(x, M, K, buf, Panel<T>::kSmall);
  const int64_t nb = K / 256, ldw = nb * Panel<T>::kBytes, rows = NV * kPanel;
  const int64_t tasks = (N + rows - 1) / rows;
  at::parallel_for(0, tasks, 1, [&](int64_t t0, int64_t t1) {
    std::vector<PanelBlock> packed(NV * nb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * rows;
      const int valid = static_cast<int>(std::min(rows, N - n0));
      for (int v = 0; v < NV; ++v) {
        const int r = std::max(0, std::min(kPanel, valid - kPanel * v));
        for (int64_t ib = 0; ib < nb; ++ib)
          Panel<T>::pack(w + (n0 + kPanel * v) * ldw, ldw, r, ib, packed[v * nb + ib]);
      }
      const PanelBlock* const p[NV] = {packed.data(), packed.data() + nb};
      int64_t m = 0;
      for (; m + MR <= M; m += MR) panel_tile<T, NV, MR>(p, nb, a + m * nb, nb, y + m * N + n0, N, valid);
      const ABlock* am = a + m * nb;
      float* ym = y + m * N + n0;
      switch (M - m) {
        case 3: panel_tile<T, NV, 3>(p, nb, am, nb, ym, N, valid); break;
        case 2: panel_tile<T, NV, 2>(p, nb, am, nb, ym, N, valid); break;
        case 1: panel_tile<T, NV, 1>(p, nb, am, nb, ym, N, valid); break;
        default: break;
      }
    }
  });
}

}  // namespace i8
}  // namespace rsmem
#endif
