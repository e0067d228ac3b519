// Routes 0 and 1 of rsmem::qmatmul (qmatmul.cpp) with float32 activations: blocks dequantized into registers
// and multiplied with up to eight activation rows at a time (route 0, few rows), or dequantized into tiles
// of kTileRows weight rows for at::mm (route 1, many rows, without AVX512-BF16). Both give the reference's
// values; only the summation order differs.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>
#include <type_traits>

#include "blocks.h"
#include "pool.h"

namespace rsmem {

constexpr int64_t kTileRows = 64;
constexpr int64_t kPrefetchGroups = 2;

// Dequantize `nb` blocks of one row into y (K floats).
template <class T>
void dequant_row(const uint8_t* row, int64_t nb, float* y) {
  for (int64_t ib = 0; ib < nb; ++ib) {
#ifdef RSMEM_AVX512
    Scales s;
    T::scales(row + ib * T::TS, s);
    for (int j = 0; j < T::BS / 32; ++j) {
      __m512 w0, w1;
      Step<T>::get(row + ib * T::TS, s, j, w0, w1);
      _mm512_storeu_ps(y + ib * T::BS + 32 * j, w0);
      _mm512_storeu_ps(y + ib * T::BS + 32 * j + 16, w1);
    }
#else
    T::scalar(row + ib * T::TS, y + ib * T::BS);
#endif
  }
}

// y[m * ldy + r] = dot(x row m, W row r) for r < NR, m < MR.
template <class T, int NR, int MR>
inline void tile_dot(const uint8_t* w, int64_t ldw, int64_t nb, const float* x, int64_t ldx, float* y,
                     int64_t ldy) {
#ifdef RSMEM_AVX512
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  // The rows of the group kPrefetchGroups ahead, NR * TS bytes per block: when this group is done, that
  // one is on its way from memory (a decode step streams its weights once; the hardware prefetcher follows
  // NR interleaved streams of short rows poorly).
  const uint8_t* pf = w + kPrefetchGroups * NR * ldw;
  for (int64_t ib = 0; ib < nb; ++ib) {
    for (int off = 0; off < NR * T::TS; off += 64) _mm_prefetch((const char*)(pf + ib * NR * T::TS + off), _MM_HINT_T0);
    Scales s[NR];
    for (int r = 0; r < NR; ++r) T::scales(w + r * ldw + ib * T::TS, s[r]);
    for (int j = 0; j < T::BS / 32; ++j) {
      __m512 w0[NR], w1[NR];
      for (int r = 0; r < NR; ++r) Step<T>::get(w + r * ldw + ib * T::TS, s[r], j, w0[r], w1[r]);
      const float* xj = x + ib * T::BS + 32 * j;
      for (int m = 0; m < MR; ++m) {
        const __m512 x0 = _mm512_loadu_ps(xj + m * ldx), x1 = _mm512_loadu_ps(xj + m * ldx + 16);
        for (int r = 0; r < NR; ++r) {
          acc[r][m] = _mm512_fmadd_ps(w0[r], x0, acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(w1[r], x1, acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);
#else
  float acc[NR][MR][16] = {};
  float buf[T::BS];
  for (int64_t ib = 0; ib < nb; ++ib)
    for (int r = 0; r < NR; ++r) {
      T::scalar(w + r * ldw + ib * T::TS, buf);
      for (int m = 0; m < MR; ++m) {
        const float* xb = x + m * ldx + ib * T::BS;
        for (int i = 0; i < T::BS; i += 16)
          for (int l = 0; l < 16; ++l) acc[r][m][l] += buf[i + l] * xb[i + l];
      }
    }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      float t = 0.f;
      for (int l = 0; l < 16; ++l) t += acc[r][m][l];
      y[m * ldy + r] = t;
    }
#endif
}

// All M activation rows against NR weight rows: in register tiles of NR x MR (NR * MR accumulators).
template <class T, int NR>
void rows_all_m(const uint8_t* w, int64_t ldw, int64_t nb, const float* x, int64_t M, int64_t K, float* y,
                int64_t N) {
  constexpr int MR = NR >= 4 ? 4 : 8;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile_dot<T, NR, MR>(w, ldw, nb, x + m * K, K, y + m * N, N);
  const float* xm = x + m * K;
  float* ym = y + m * N;
  switch (M - m) {
    case 7: tile_dot<T, NR, 7>(w, ldw, nb, xm, K, ym, N); break;
    case 6: tile_dot<T, NR, 6>(w, ldw, nb, xm, K, ym, N); break;
    case 5: tile_dot<T, NR, 5>(w, ldw, nb, xm, K, ym, N); break;
    case 4: tile_dot<T, NR, 4>(w, ldw, nb, xm, K, ym, N); break;
    case 3: tile_dot<T, NR, 3>(w, ldw, nb, xm, K, ym, N); break;
    case 2: tile_dot<T, NR, 2>(w, ldw, nb, xm, K, ym, N); break;
    case 1: tile_dot<T, NR, 1>(w, ldw, nb, xm, K, ym, N); break;
    default: break;
  }
}

// Weight rows in groups of NR (4 for M <= 4: one pass over the weights; else 2 and eight rows of x at a
// time), and the last N % NR rows one by one.
template <class T, int NR>
void matmul_registers_nr(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / T::BS, ldw = nb * T::TS;
  const int64_t groups = (N + NR - 1) / NR;
  // at least ~64 KB of weights per task, so small matrices are not split into tiny pieces
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, ldw * NR));
  pool::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NR;
      if (n0 + NR <= N) {
        rows_all_m<T, NR>(w + n0 * ldw, ldw, nb, x, M, K, y + n0, N);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_all_m<T, 1>(w + n * ldw, ldw, nb, x, M, K, y + n, N);
      }
    }
  });
}

// Whether M > 4 rows go eight at a time against two weight rows (the faster for these types; Q6_K's
// unpacking needs more registers and is faster four at a time against four weight rows).
template <class T>
struct Wide : std::true_type {};
template <>
struct Wide<Q6_K> : std::false_type {};

template <class T>
void matmul_registers(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M <= 4 || !Wide<T>::value) {
    matmul_registers_nr<T, 4>(x, w, y, M, N, K);
  } else {
    matmul_registers_nr<T, 2>(x, w, y, M, N, K);
  }
}

template <class T>
void matmul_tiles(const at::Tensor& x, const uint8_t* w, at::Tensor& y, int64_t N, int64_t K) {
  const int64_t nb = K / T::BS, ldw = nb * T::TS;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows, M = x.size(0);
  float* out = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor buf = at::empty({kTileRows, K}, x.options());
    float* b = buf.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequant_row<T>(w + (n0 + r) * ldw, nb, b + r * K);
      // rows written through the pointer: at::parallel_for's threads do not inherit InferenceMode, and
      // an in-place op there on `y` (an inference tensor under Context.decode) would be refused
      const at::Tensor part = at::mm(x, buf.narrow(0, 0, rows).t()).contiguous();
      const float* src = part.data_ptr<float>();
      for (int64_t m = 0; m < M; ++m) std::memcpy(out + m * N + n0, src + m * rows, rows * sizeof(float));
    }
  });
}

}  // namespace rsmem
