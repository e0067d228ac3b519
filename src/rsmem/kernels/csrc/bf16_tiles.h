// Route 2 of rsmem::qmatmul (qmatmul.cpp), where AVX512-BF16 is compiled in: activations rounded to
// bfloat16 once, tiles of weight rows dequantized to bfloat16 in cache, vdpbf16ps.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "float_routes.h"

namespace rsmem {

#if defined(RSMEM_AVX512) && defined(__AVX512BF16__)
#define RSMEM_BF16 1
// Route 2: activations rounded to bfloat16 once, packed 16 rows to a zmm (a row's two neighbouring values
// in each 32-bit lane, [group][k / 2][16 rows]); weight tiles dequantized to bfloat16 rows in cache; the
// products with vdpbf16ps (exact bf16 products, float32 sums and outputs).
constexpr int kPairRows = 16;

inline at::Tensor pack_bf16(const float* x, int64_t M, int64_t K) {
  const int64_t groups = (M + kPairRows - 1) / kPairRows, kp = K / 2;
  at::Tensor packed = at::zeros({groups, kp, kPairRows}, at::TensorOptions().dtype(at::kInt));
  uint32_t* p = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    alignas(64) uint32_t pairs[16];
    for (int64_t m = m0; m < m1; ++m) {
      uint32_t* dst = p + (m / kPairRows) * kp * kPairRows + m % kPairRows;
      for (int64_t k = 0; k < K; k += 32) {
        const __m512 lo = _mm512_loadu_ps(x + m * K + k), hi = _mm512_loadu_ps(x + m * K + k + 16);
        _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        for (int i = 0; i < 16; ++i) dst[(k / 2 + i) * kPairRows] = pairs[i];
      }
    }
  });
  return packed;
}

// One row of blocks as bfloat16 values (rounded to nearest even).
template <class T>
inline void dequant_row_bf16(const uint8_t* row, int64_t nb, uint16_t* y) {
  for (int64_t ib = 0; ib < nb; ++ib) {
    Scales s;
    T::scales(row + ib * T::TS, s);
    for (int j = 0; j < T::BS / 32; ++j) {
      __m512 w0, w1;
      Step<T>::get(row + ib * T::TS, s, j, w0, w1);
      _mm512_storeu_si512(y + ib * T::BS + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
  }
}

// y[m, n0 + r] for GM groups of 16 rows m and NW weight rows r (bf16 rows of K values at w, stride K).
template <int GM, int NW>
inline void bf16_tile(const uint32_t* xp, int64_t group_stride, const uint16_t* w, int64_t K, float* y,
                      int64_t ldy, int64_t rows_left) {
  __m512 acc[GM][NW];
  for (int g = 0; g < GM; ++g)
    for (int r = 0; r < NW; ++r) acc[g][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh xv[GM];
    for (int g = 0; g < GM; ++g)
      xv[g] = (__m512bh)_mm512_loadu_si512(xp + g * group_stride + kp * kPairRows);
    for (int r = 0; r < NW; ++r) {
      uint32_t pair;
      std::memcpy(&pair, w + r * K + 2 * kp, 4);
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int g = 0; g < GM; ++g) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], xv[g], wv);
    }
  }
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(ldy)));
  for (int g = 0; g < GM; ++g) {
    const int64_t valid = std::min<int64_t>(kPairRows, rows_left - g * kPairRows);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < NW; ++r)
      _mm512_mask_i32scatter_ps(y + g * kPairRows * ldy + r, mask, idx, acc[g][r], 4);
  }
}

template <class T>
void matmul_bf16(const at::Tensor& x, const uint8_t* w, at::Tensor& y, int64_t M, int64_t N, int64_t K) {
  constexpr int NW = 8;
  const int64_t nb = K / T::BS, ldw = nb * T::TS, kp = K / 2;
  const at::Tensor packed = pack_bf16(x.data_ptr<float>(), M, K);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const int64_t groups = packed.size(0), group_stride = kp * kPairRows;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint16_t> tile(kTileRows * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequant_row_bf16<T>(w + (n0 + r) * ldw, nb, tile.data() + r * K);
      for (int64_t r0 = 0; r0 < rows; r0 += NW) {
        const uint16_t* wt = tile.data() + r0 * K;
        float* yt = out + n0 + r0;
        const bool full = r0 + NW <= rows;
        for (int64_t g = 0; g < groups; g += 2) {
          const uint32_t* xg = xp + g * group_stride;
          float* yg = yt + g * kPairRows * N;
          const int64_t left = M - g * kPairRows;
          if (full && g + 2 <= groups) {
            bf16_tile<2, NW>(xg, group_stride, wt, K, yg, N, left);
          } else if (full) {
            bf16_tile<1, NW>(xg, group_stride, wt, K, yg, N, left);
          } else {
            for (int64_t r = r0; r < rows; ++r) {
              for (int64_t gg = g; gg < std::min(g + 2, groups); ++gg)
                bf16_tile<1, 1>(xp + gg * group_stride, group_stride, tile.data() + r * K, K,
                                out + n0 + r + gg * kPairRows * N, N, M - gg * kPairRows);
            }
          }
        }
      }
    }
  });
}
#endif

}  // namespace rsmem
