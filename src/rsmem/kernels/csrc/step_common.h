// What the C++ decode steps (mamba_step.cpp, mamba2_step.cpp, hybrid_step.cpp, rwkv7_step.cpp,
// rwkv6_step.cpp) share: scalar activations, RMS and layer norms of a row, operand checks that name the op and
// the operand, the products of a float32 matrix (the few-row kernel, rows_kernel.h, or its oneDNN packed
// twin) or of quantized / F16 / BF16 blocks (rsmem_native::qmatmul through the dispatcher, so the steps need
// not see its translation unit), low-rank products, and per-row work shared between rsmem's workers.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "pool.h"
#include "rows_kernel.h"
#include "vec_math.h"

#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif
#define RSMEM_NAME2(ns) #ns
#define RSMEM_NAME(ns) RSMEM_NAME2(ns)

namespace rsmem {
namespace step {

// A step's layer operands are named by two enums, <Name>Field over its tensors and <Name>Matrix over the qtypes of
// its matrices, each in the order and with the names (upper-cased) of rsmem.models.step.operands'
// StepOperands("<Name>") (tests/kernels/test_step_operands.py compares them); each enum is held in a struct so
// that its names stay scoped while indexing as integers.

// Mamba-2's layer (mamba2_step, hybrid_step's Mamba-2 block): window [M, conv_dim, K-1] and h [M, H, P, N] are its
// states, updated in place
struct Mamba2Field {
  enum : int64_t { NORM, IN_PROJ, CONV_WEIGHT, CONV_BIAS, DT_BIAS, A, D, SSM_NORM, OUT_PROJ, WINDOW, H, N_FIELDS };
};
struct Mamba2Matrix {
  enum : int64_t { IN_PROJ, OUT_PROJ, N_MATRICES };
};

inline float silu(float v) { return v / (1.f + std::exp(-v)); }

inline float softplus(float v) { return v > 20.f ? v : std::log1p(std::exp(v)); }

// out = x / sqrt(mean(x^2) + eps) * w over n values (gate_row without a gate gives the sum of squares)
inline void rms_norm_row(const float* __restrict x, const float* __restrict w, float* __restrict out, int64_t n,
                         float eps) {
  const float scale = 1.f / std::sqrt(gate_row(x, nullptr, out, n) / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = out[j] * scale * w[j];
}

// rms_norm_row of each of M contiguous rows of n values
inline void rms_norm_rows(const float* x, const float* w, float* out, int64_t M, int64_t n, float eps) {
  for (int64_t m = 0; m < M; ++m) rms_norm_row(x + m * n, w, out + m * n, n, eps);
}

inline void check_f32(const char* op, const at::Tensor& t, int64_t numel, const char* what) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.device().is_cpu() && t.is_contiguous() && t.numel() == numel,
                    op, ": ", what, " must be a contiguous float32 CPU tensor of ", numel, " values, got ",
                    t.scalar_type(), " ", t.sizes());
}

// qtype of a float32 [out, in] matrix given as its oneDNN packed twin (torch.ops.mkldnn._reorder_linear_weight):
// the products of many rows run through oneDNN's blocked product on it; the caller passes it from the rows
// where that beats the few-row kernel (rsmem.models.step.native.PACKED_FROM_ROWS)
constexpr int64_t kPackedF32 = -2;

// qtype of a float32 [out, in] matrix whose products run through oneDNN packed slices of its rows
// (rows::sliced_product), from the op's `slices` argument; the matrix's own operand is the plain matrix
// (checked as qtype -1). The caller passes it from the rows where it beats the few-row kernel
// (rsmem.models.step.native.SLICED_FROM_ROWS).
constexpr int64_t kSlicedF32 = -3;

// The op's `slices`: `per` packed slices for each matrix in the order of its qtypes, the head's last; only
// those of kSlicedF32 matrices are read (the others' may be any tensors)
struct Slices {
  at::TensorList all;
  int64_t per = 0;
  at::TensorList of(int64_t j) const {
    return per == 0 ? at::TensorList() : all.slice(static_cast<size_t>(j * per), static_cast<size_t>(per));
  }
};

// `slices` for `matrices` matrices of `per` slices each (none when no matrix is sliced)
inline Slices check_slices(const char* op, at::TensorList slices, int64_t per, int64_t matrices) {
  TORCH_CHECK_VALUE(per >= 0 && static_cast<int64_t>(slices.size()) == per * matrices, op, ": ", per,
                    " slices for each of ", matrices, " matrices, got ", slices.size());
  return Slices{slices, per};
}

// a matrix of N rows of K values: float32 [N, K] with contiguous rows (qtype -1), its oneDNN packed twin
// (kPackedF32), else N rows of uint8 blocks (their row length is rsmem_native::qmatmul's check)
inline void check_matrix(const char* op, const at::Tensor& w, int64_t qtype, int64_t N, int64_t K,
                         const char* what, at::TensorList slices = {}) {
  if (qtype == kSlicedF32) {
    TORCH_CHECK_VALUE(!slices.empty(), op, ": ", what, " is sliced (qtype -3) but the op has no slices");
    int64_t rows = 0;
    for (const at::Tensor& s : slices) {
      TORCH_CHECK_VALUE(s.is_mkldnn() && s.scalar_type() == at::kFloat && s.dim() == 2 && s.size(1) == K, op, ": ",
                        what, "'s slices must be oneDNN's packed float32 [rows, ", K, "], got ", s.scalar_type(),
                        " ", s.sizes(), s.is_mkldnn() ? " (packed)" : " (not packed)");
      rows += s.size(0);
    }
    TORCH_CHECK_VALUE(rows == N, op, ": ", what, "'s slices hold ", rows, " rows, not ", N);
    qtype = -1;  // and the matrix itself is the plain one
  }
  if (qtype == kPackedF32) {
    TORCH_CHECK_VALUE(w.is_mkldnn() && w.scalar_type() == at::kFloat && w.dim() == 2 && w.size(0) == N &&
                          w.size(1) == K,
                      op, ": ", what, " must be oneDNN's packed float32 [", N, ", ", K, "], got ", w.scalar_type(),
                      " ", w.sizes(), w.is_mkldnn() ? " (packed)" : " (not packed)");
  } else if (qtype < 0) {
    TORCH_CHECK_VALUE(qtype == -1 && w.scalar_type() == at::kFloat && w.device().is_cpu() && !w.is_mkldnn() &&
                          w.dim() == 2 && w.size(0) == N && w.size(1) == K && (w.stride(1) == 1 || K <= 1),
                      op, ": ", what, " must be float32 [", N, ", ", K, "] with contiguous rows (qtype -1), got ",
                      w.scalar_type(), " ", w.sizes(), " qtype ", qtype);
  } else {
    TORCH_CHECK_VALUE(w.scalar_type() == at::kByte && w.device().is_cpu() && !w.is_mkldnn() && w.dim() == 2 &&
                          w.size(0) == N,
                      op, ": ", what, " must be ", N, " rows of uint8 blocks, got ", w.scalar_type(), " ",
                      w.sizes());
  }
}

// One token of a causal depthwise convolution and SiLU over C channels: out[c] = silu(bias[c] + w[c] .
// (window[c], in[c])) with w [C, K] and window [C, K-1] (oldest first), which then moves by one (in[c] last).
inline void conv_silu_token(const float* __restrict in, float* __restrict window, const float* __restrict w,
                            const float* __restrict bias, float* __restrict out, int64_t C, int64_t K) {
  for (int64_t c = 0; c < C; ++c) {
    float* wc = window + c * (K - 1);
    const float* kc = w + c * K;
    float acc = bias[c];
    for (int64_t k = 0; k < K - 1; ++k) acc += kc[k] * wc[k];
    acc += kc[K - 1] * in[c];
    for (int64_t k = 0; k + 1 < K - 1; ++k) wc[k] = wc[k + 1];
    wc[K - 2] = in[c];
    out[c] = silu(acc);
  }
}

inline float sigmoid(float v) { return 1.f / (1.f + std::exp(-v)); }

// out = layer_norm(x) over n values with weight w and bias b
inline void layer_norm_row(const float* x, const float* w, const float* b, float* out, int64_t n, float eps) {
  float mean = 0.f, var = 0.f;
  for (int64_t j = 0; j < n; ++j) mean += x[j];
  mean /= static_cast<float>(n);
  for (int64_t j = 0; j < n; ++j) var += (x[j] - mean) * (x[j] - mean);
  const float inv = 1.f / std::sqrt(var / static_cast<float>(n) + eps);
  for (int64_t j = 0; j < n; ++j) out[j] = (x[j] - mean) * inv * w[j] + b[j];
}

inline void layer_norm_rows(const float* x, const float* w, const float* b, float* out, int64_t M, int64_t n,
                     float eps) {
  for (int64_t m = 0; m < M; ++m) layer_norm_row(x + m * n, w, b, out + m * n, n, eps);
}

// x [M, K] (contiguous) @ W^T for a checked matrix (check_matrix; `slices` its slices when it is sliced)
inline at::Tensor product(const at::Tensor& x, const at::Tensor& w, int64_t qtype, at::TensorList slices = {}) {
  if (qtype == kSlicedF32) return rows::sliced_product(x, slices, w.size(0));
  if (qtype == kPackedF32) return rows::packed_product(x, w);
  if (qtype < 0) {  // the few-row kernel for any count: the caller gives the big matrices packed where it pays
    const int64_t M = x.size(0), N = w.size(0), Kd = x.size(1);
    at::Tensor y = at::empty({M, N}, x.options());
    rows::product<rows::F32W>(x.data_ptr<float>(), Kd, w.data_ptr<float>(), Kd <= 1 ? Kd : w.stride(0), M, N, Kd,
                              y.data_ptr<float>());
    return y;
  }
  static const auto op = c10::Dispatcher::singleton()
                             .findSchemaOrThrow(RSMEM_NAME(RSMEM_OPS_NS) "::qmatmul", "")
                             .typed<at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t)>();
  return op.call(x, w, qtype, x.size(1), -1);
}

// the residual: x [M, n] += y @ W^T (W [n, K])
inline void add_product(float* __restrict x, const at::Tensor& y, const at::Tensor& w, int64_t qtype,
                        at::TensorList slices = {}) {
  const at::Tensor out = product(y, w, qtype, slices);
  const float* op = out.data_ptr<float>();
  const int64_t total = out.numel();
  for (int64_t j = 0; j < total; ++j) x[j] += op[j];
}

// a low-rank matrix: float32 [rows, cols], contiguous
inline void check_lora(const char* op, const at::Tensor& t, int64_t rows, int64_t cols, const char* what) {
  TORCH_CHECK_VALUE(t.scalar_type() == at::kFloat && t.dim() == 2 && t.is_contiguous() &&
                        (rows < 0 || t.size(0) == rows) && (cols < 0 || t.size(1) == cols),
                    op, ": ", what, " must be a contiguous float32 matrix [", rows, ", ", cols, "], got ",
                    t.scalar_type(), " ", t.sizes());
}

// y [M, N] (row stride N) = x [M, K] (row stride ldx) @ w [N, K]^T (contiguous) for a small K (a low-rank
// matrix's second factor, K <= kLowRankMaxK): w transposed into [K, N], then each output row a sum of K
// scaled rows of that, four rows and 64 outputs at a time in registers. The few-row kernel does one horizontal sum an
// output, which at K = 32 costs more than its multiply-adds.
inline void low_rank_rows(const float* __restrict x, int64_t ldx, int64_t M, int64_t K, const at::Tensor& w,
                          float* __restrict y) {
  const int64_t N = w.size(0);
  thread_local std::vector<float> buffer;  // w^T [K, N]
  buffer.resize(static_cast<size_t>(K * N));
  float* __restrict wt = buffer.data();
  const float* __restrict wp = w.data_ptr<float>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t k = 0; k < K; ++k) wt[k * N + n] = wp[n * K + k];
  int64_t n0 = 0;
#if defined(__AVX512F__)
  constexpr int kR = 4, kV = 4;  // rows, vectors of 16 outputs
  for (; n0 + 16 * kV <= N; n0 += 16 * kV) {
    int64_t m = 0;
    for (; m + kR <= M; m += kR) {
      __m512 acc[kR][kV];
      for (int r = 0; r < kR; ++r)
        for (int v = 0; v < kV; ++v) acc[r][v] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        __m512 wv[kV];
        for (int v = 0; v < kV; ++v) wv[v] = _mm512_loadu_ps(wt + k * N + n0 + 16 * v);
        for (int r = 0; r < kR; ++r) {
          const __m512 xb = _mm512_set1_ps(x[(m + r) * ldx + k]);
          for (int v = 0; v < kV; ++v) acc[r][v] = _mm512_fmadd_ps(xb, wv[v], acc[r][v]);
        }
      }
      for (int r = 0; r < kR; ++r)
        for (int v = 0; v < kV; ++v) _mm512_storeu_ps(y + (m + r) * N + n0 + 16 * v, acc[r][v]);
    }
    for (; m < M; ++m) {
      __m512 acc[kV];
      for (int v = 0; v < kV; ++v) acc[v] = _mm512_setzero_ps();
      for (int64_t k = 0; k < K; ++k) {
        const __m512 xb = _mm512_set1_ps(x[m * ldx + k]);
        for (int v = 0; v < kV; ++v) acc[v] = _mm512_fmadd_ps(xb, _mm512_loadu_ps(wt + k * N + n0 + 16 * v), acc[v]);
      }
      for (int v = 0; v < kV; ++v) _mm512_storeu_ps(y + m * N + n0 + 16 * v, acc[v]);
    }
  }
#endif
  for (int64_t m = 0; m < M; ++m) {  // the outputs left (all of them without AVX-512)
    float* yr = y + m * N;
    for (int64_t n = n0; n < N; ++n) yr[n] = 0.f;
    for (int64_t k = 0; k < K; ++k) {
      const float xv = x[m * ldx + k];
      const float* wr = wt + k * N;
      for (int64_t n = n0; n < N; ++n) yr[n] += xv * wr[n];
    }
  }
}

// Rows and inner size from which a low-rank product takes low_rank_rows (fewer rows: the few-row kernel; at
// a few rows the per-call transposition costs more than low_rank_rows saves)
constexpr int64_t kLowRankRows = 32;
constexpr int64_t kLowRankMaxK = 128;

// x [M, K] @ lora [N, K]^T for a checked low-rank matrix
inline at::Tensor lora(const at::Tensor& x, const at::Tensor& w) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M < kLowRankRows || K > kLowRankMaxK || !x.is_contiguous()) return product(x, w, -1);
  at::Tensor y = at::empty({M, w.size(0)}, x.options());
  low_rank_rows(x.data_ptr<float>(), K, M, K, w, y.data_ptr<float>());
  return y;
}

// f on every value of a fresh contiguous float32 tensor, in place, on this thread (at::tanh and
// at::sigmoid go to MKL's vector math, which opened an OpenMP region, waking torch's sleeping thread, for
// 160 values: ~100 wake-ups a token of the 130M RWKV-6)
template <class F>
inline at::Tensor map_(at::Tensor t, F f) {
  float* p = t.data_ptr<float>();
  const int64_t n = t.numel();
  for (int64_t i = 0; i < n; ++i) p[i] = f(p[i]);
  return t;
}

inline float tanh_(float v) { return std::tanh(v); }

// Values of per-row work (norms, lerps, activations) from which a step shares its rows between rsmem's
// workers: below it (one sequence, a few) the hand-off costs more than the work.
constexpr int64_t kRowWorkGrain = 16384;

// f(m) for every row m of M rows of `width` values, the rows shared between rsmem's workers (pool.h) when
// there are enough of them; f must touch only its own row's outputs
template <class F>
inline void each_row(int64_t M, int64_t width, const F& f) {
  const int64_t grain = std::max<int64_t>(1, kRowWorkGrain / std::max<int64_t>(1, width));
  pool::parallel_for(0, M, grain, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) f(m);
  });
}

}  // namespace step
}  // namespace rsmem
