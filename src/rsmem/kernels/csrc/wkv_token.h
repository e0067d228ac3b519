// One token of RWKV's WKV recurrences for one head, shared by the decode steps (rwkv7_step.cpp,
// rwkv6_step.cpp) and the prompt scans (wkv_scan.cpp). Reference twins: rsmem.models.ops.wkv.wkv7_step_
// and rsmem.models.ops.wkv6.wkv6_step_.
#pragma once

#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace rsmem {
namespace wkv {

#if defined(__AVX512F__)
// token7's rows [vi, vi + R) of S (N a multiple of 16) with AVX-512, their R chains of sums interleaved:
// one row at a time, each row would wait on its two horizontal sums.
template <int R>
inline void rows7(float* __restrict S, const float* __restrict r, const float* __restrict w,
                  const float* __restrict k, const float* __restrict v, const float* __restrict a,
                  const float* __restrict b, float* __restrict y, int64_t N, int64_t vi) {
  __m512 acc[R];
  for (int q = 0; q < R; ++q) acc[q] = _mm512_setzero_ps();
  for (int64_t j = 0; j < N; j += 16) {
    const __m512 aj = _mm512_loadu_ps(a + j);
    for (int q = 0; q < R; ++q) acc[q] = _mm512_fmadd_ps(_mm512_loadu_ps(S + (vi + q) * N + j), aj, acc[q]);
  }
  __m512 sa[R], vv[R];
  for (int q = 0; q < R; ++q) {
    sa[q] = _mm512_set1_ps(_mm512_reduce_add_ps(acc[q]));
    vv[q] = _mm512_set1_ps(v[vi + q]);
    acc[q] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < N; j += 16) {
    const __m512 wj = _mm512_loadu_ps(w + j), bj = _mm512_loadu_ps(b + j), kj = _mm512_loadu_ps(k + j);
    const __m512 rj = _mm512_loadu_ps(r + j);
    for (int q = 0; q < R; ++q) {
      float* row = S + (vi + q) * N + j;
      const __m512 s = _mm512_fmadd_ps(vv[q], kj, _mm512_fmadd_ps(_mm512_loadu_ps(row), wj, _mm512_mul_ps(sa[q], bj)));
      _mm512_storeu_ps(row, s);
      acc[q] = _mm512_fmadd_ps(s, rj, acc[q]);
    }
  }
  for (int q = 0; q < R; ++q) y[vi + q] = _mm512_reduce_add_ps(acc[q]);
}
#endif

// RWKV-7, S [N(v), N(k)]: S = S diag(w) + (S a) b^T + v k^T, then y = S r
inline void token7(float* __restrict S, const float* __restrict r, const float* __restrict w,
                   const float* __restrict k, const float* __restrict v, const float* __restrict a,
                   const float* __restrict b, float* __restrict y, int64_t N) {
#if defined(__AVX512F__)
  if (N % 16 == 0) {
    for (int64_t vi = 0; vi < N; vi += 4) rows7<4>(S, r, w, k, v, a, b, y, N, vi);
    return;
  }
#endif
  for (int64_t vi = 0; vi < N; ++vi) {
    float* row = S + vi * N;
    float sa = 0.f;
#pragma omp simd reduction(+ : sa)
    for (int64_t j = 0; j < N; ++j) sa += row[j] * a[j];
    const float vv = v[vi];
    float acc = 0.f;
#pragma omp simd reduction(+ : acc)
    for (int64_t j = 0; j < N; ++j) {
      const float s = row[j] * w[j] + sa * b[j] + vv * k[j];
      row[j] = s;
      acc += s * r[j];
    }
    y[vi] = acc;
  }
}

// RWKV-6, S [N(k), N(v)]: y = S^T r + (r . u k) v, then S = diag(w) S + k v^T
inline void token6(float* __restrict S, const float* __restrict r, const float* __restrict w,
                   const float* __restrict k, const float* __restrict v, const float* __restrict u,
                   float* __restrict y, int64_t N) {
  float bonus = 0.f;
  for (int64_t j = 0; j < N; ++j) bonus += r[j] * u[j] * k[j];
#pragma omp simd
  for (int64_t c = 0; c < N; ++c) y[c] = bonus * v[c];
  for (int64_t j = 0; j < N; ++j) {
    float* row = S + j * N;
    const float rj = r[j], wj = w[j], kj = k[j];
#pragma omp simd
    for (int64_t c = 0; c < N; ++c) {
      y[c] += row[c] * rj;
      row[c] = row[c] * wj + kj * v[c];
    }
  }
}

}  // namespace wkv
}  // namespace rsmem
