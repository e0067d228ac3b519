// Vectorised row math shared by the kernels: exp16, exp(x) for 16 floats (AVX-512), a Cephes-style
// polynomial, ~1 ulp over the float range (clamped to [-87.3, 88.3]), and sigmoid16; gate_row, the gated
// norm's pass over a row (gated_norm.cpp, the decode steps); update_row, one row of Mamba-2's state update
// (ssd_scan.cpp, mamba2_step.cpp).
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace rsmem {

#if defined(__AVX512F__)
// exp(x) for 16 floats: x = n ln2 + r, |r| <= ln2 / 2, exp(r) by a degree-6 polynomial, times 2^n
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.3f)), _mm512_set1_ps(88.3f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}

// 1 / (1 + exp(-x)) for 16 floats
inline __m512 sigmoid16(__m512 x) {
  const __m512 one = _mm512_set1_ps(1.f);
  return _mm512_div_ps(one, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
}
#endif

// gz = y * silu(z) over n values (y itself when z is null); returns the sum of gz^2
inline float gate_row(const float* __restrict y, const float* __restrict z, float* __restrict gz, int64_t n) {
  int64_t j = 0;
  float ss = 0.f;
#if defined(__AVX512F__)
  const __m512 one = _mm512_set1_ps(1.f);
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    __m512 g = _mm512_loadu_ps(y + j);
    if (z != nullptr) {
      const __m512 zv = _mm512_loadu_ps(z + j);
      g = _mm512_mul_ps(g, _mm512_div_ps(zv, _mm512_add_ps(one, exp16(_mm512_sub_ps(_mm512_setzero_ps(), zv)))));
    }
    _mm512_storeu_ps(gz + j, g);
    acc = _mm512_fmadd_ps(g, g, acc);
  }
  ss = _mm512_reduce_add_ps(acc);
#endif
  for (; j < n; ++j) {
    const float g = z != nullptr ? y[j] * (z[j] / (1.f + std::exp(-z[j]))) : y[j];
    gz[j] = g;
    ss += g * g;
  }
  return ss;
}

// One state row [N]: row = row * dA + xdt * B; returns row . C (the row after the update).
inline float update_row(float* __restrict row, const float* __restrict Bt, const float* __restrict Ct,
                        int64_t N, float dA, float xdt) {
  int64_t n = 0;
  float acc = 0.f;
#if defined(__AVX512F__)
  const __m512 vdA = _mm512_set1_ps(dA), vx = _mm512_set1_ps(xdt);
  __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
  for (; n + 32 <= N; n += 32) {
    __m512 v0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + n), vdA, _mm512_mul_ps(vx, _mm512_loadu_ps(Bt + n)));
    __m512 v1 = _mm512_fmadd_ps(_mm512_loadu_ps(row + n + 16), vdA,
                                _mm512_mul_ps(vx, _mm512_loadu_ps(Bt + n + 16)));
    _mm512_storeu_ps(row + n, v0);
    _mm512_storeu_ps(row + n + 16, v1);
    a0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(Ct + n), a0);
    a1 = _mm512_fmadd_ps(v1, _mm512_loadu_ps(Ct + n + 16), a1);
  }
  for (; n + 16 <= N; n += 16) {
    __m512 v0 = _mm512_fmadd_ps(_mm512_loadu_ps(row + n), vdA, _mm512_mul_ps(vx, _mm512_loadu_ps(Bt + n)));
    _mm512_storeu_ps(row + n, v0);
    a0 = _mm512_fmadd_ps(v0, _mm512_loadu_ps(Ct + n), a0);
  }
  acc = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
#endif
  for (; n < N; ++n) {
    const float v = row[n] * dA + xdt * Bt[n];
    row[n] = v;
    acc += v * Ct[n];
  }
  return acc;
}

}  // namespace rsmem
