// One token of RWKV's WKV recurrences for one head, shared by the decode steps (rwkv7_step.cpp,
// rwkv6_step.cpp) and the prompt scans (wkv_scan.cpp). Reference twins: rsmem.models.ops.wkv.wkv7_step_
// and rsmem.models.ops.wkv6.wkv6_step_.
#pragma once

#include <cstdint>

namespace rsmem {
namespace wkv {

// RWKV-7, S [N(v), N(k)]: S = S diag(w) + (S a) b^T + v k^T, then y = S r
inline void token7(float* __restrict S, const float* __restrict r, const float* __restrict w,
                   const float* __restrict k, const float* __restrict v, const float* __restrict a,
                   const float* __restrict b, float* __restrict y, int64_t N) {
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
