// Few-row float32 products y = x @ w^T for x [M, K] (M = 1..16 activation rows, e.g. one token of each of
// a few sequences) and w [N, K] row-major float32 (a model's [out, in] matrix), streaming w once.
//
// A block of R output rows (R weight rows) meets every activation row: R x MB accumulators (MB <= 8 rows
// at a time) sit in registers, inner products run along K 16 (AVX-512) or 8 (AVX2) values at a time, the
// horizontal sums come once at the end of the block. The block's weight rows are read from memory once;
// a second group of activation rows (M > 8) reads them again from cache. The next block is prefetched
// while this one is multiplied. Output row blocks are shared between threads (at::parallel_for), each
// thread with at least kMinBytesPerThread of weights (a second thread on a busy machine costs more than a
// small product saves).
//
// oneDNN's packed product reads a 130M model's matrices at ~7 GB/s at 8 rows on this machine kind, a third
// of the one-row GEMV's rate; this kernel is for the rows where it measures faster (the caller decides).
// Its reference twin is x @ w.t() (rsmem.models.ops.small_rows.rows_ref; tests/kernels/test_rows_f32.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace rsmem {
namespace {

constexpr int64_t kMaxRows = 8;                      // activation rows per register group
constexpr int64_t kMinBytesPerThread = 1 << 20;      // weights a thread gets at least
constexpr int64_t kTile = 24;                        // output rows all groups meet before the next (M > 8)
constexpr int64_t kAhead = 2;                        // blocks ahead that the prefetch reads (into L2)

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
inline vec vload_tail(const float* p, int64_t n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p);
}
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
inline vec vload_tail(const float* p, int64_t n) {
  alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  std::copy(p, p + n, buf);
  return _mm256_load_ps(buf);
}
#endif

#if defined(__AVX512F__) || defined(__AVX2__)
// y[m, n0 + r] for r < R, m < MB: the weight rows w + (n0 + r) * ldw against the activation rows x + m * ldx.
// `next` (R rows of a later block, or null) is prefetched into L2 as this block goes: into L1, or just the
// next block, gains nothing here; kAhead blocks ahead into L2 lets the loads overlap the multiply-adds
// (8 rows of [65536, 768], one thread: 9.0 -> 14.3 GB/s).
template <int R, int MB>
inline void block(const float* __restrict w, int64_t ldw, const float* __restrict x, int64_t ldx, int64_t K,
                  float* __restrict y, int64_t ldy, const float* next, bool add) {
  vec acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (next != nullptr && (k & 15) == 0)  // a cache line a row a step (AVX2: every other step)
      for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(next + r * ldw + k), _MM_HINT_T1);
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload(w + r * ldw + k);
    for (int m = 0; m < MB; ++m) {
      vec xv = vload(x + m * ldx + k);
      // in a register, loaded once: else the compiler folds the load into each of the R products (R loads
      // a vector, which on Zen 4 makes the loop bound by loads instead of multiply-adds)
      __asm__("" : "+v"(xv));
      for (int r = 0; r < R; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const int64_t n = K - k;
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = vload_tail(w + r * ldw + k, n);
    for (int m = 0; m < MB; ++m) {
      const vec xv = vload_tail(x + m * ldx + k, n);
      for (int r = 0; r < R; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = add ? y[m * ldy + r] + vsum(acc[r][m]) : vsum(acc[r][m]);
}

// Weight rows per block for MB activation rows: R x MB accumulators and R + 1 loads fit the registers
// (32 with AVX-512, 16 with AVX2).
template <int MB>
constexpr int rows_for() {
#if defined(__AVX512F__)
  return MB <= 2 ? 8 : MB <= 4 ? 6 : MB <= 6 ? 4 : 3;
#else
  return MB <= 1 ? 4 : MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
#endif
}
#endif

// y[0:MB, n0:n1] (MB activation rows at x, y already offset to them): full blocks of R rows, then
// the remaining rows one at a time; rows before pf_end are prefetched ahead (none when pf_end is 0).
template <int MB>
void rows_range(const float* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, float* y, int64_t ldy,
                int64_t n0, int64_t n1, int64_t pf_end) {
#if defined(__AVX512F__) || defined(__AVX2__)
  constexpr int R = rows_for<MB>();
  // K in chunks whose activation rows stay in L1 (MB x KC floats of 16 KiB) when they would not
  const int64_t KC = MB * K * 4 > (24 << 10) ? std::max<int64_t>(kLanes, ((16 << 10) / (4 * MB)) & ~(kLanes - 1)) : K;
  for (int64_t k0 = 0; k0 < K; k0 += KC) {
    const int64_t kc = std::min(KC, K - k0);
    const bool add = k0 > 0;
    int64_t n = n0;
    for (; n + R <= n1; n += R) {
      const float* next = n + (kAhead + 1) * R <= pf_end ? w + (n + kAhead * R) * ldw + k0 : nullptr;
      block<R, MB>(w + n * ldw + k0, ldw, x + k0, ldx, kc, y + n, ldy, next, add);
    }
    for (; n < n1; ++n) block<1, MB>(w + n * ldw + k0, ldw, x + k0, ldx, kc, y + n, ldy, nullptr, add);
  }
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < MB; ++m) {
      const float* wr = w + n * ldw;
      const float* xr = x + m * ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += wr[k] * xr[k];
      y[m * ldy + n] = acc;
    }
#endif
}

using RangeFn = void (*)(const float*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t, int64_t,
                         int64_t);

RangeFn range_fn(int64_t mb) {
  static constexpr RangeFn table[kMaxRows] = {rows_range<1>, rows_range<2>, rows_range<3>, rows_range<4>,
                                              rows_range<5>, rows_range<6>, rows_range<7>, rows_range<8>};
  return table[mb - 1];
}

at::Tensor rows_f32(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                    "rows_f32: float32 x and w");
  TORCH_CHECK_VALUE(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1),
                    "rows_f32: x [M, K] and w [N, K], got ", x_in.sizes(), " and ", w.sizes());
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && w.device().is_cpu(), "rows_f32: CPU tensors");
  TORCH_CHECK_VALUE(w.stride(1) == 1 || w.size(1) <= 1, "rows_f32: w's rows must be contiguous");
  const at::Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const float* wp = w.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t ldw = w.size(1) <= 1 ? K : w.stride(0), ldx = x.stride(0);
  const int64_t grain = std::max<int64_t>(16, kMinBytesPerThread / (4 * K));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    // one group of rows streams the whole range; more groups take it a tile at a time, the tile's weight
    // rows read from memory by the first group and from cache by the others
    const int64_t tile = M <= kMaxRows ? n1 - n0 : kTile;
    for (int64_t t0 = n0; t0 < n1; t0 += tile) {
      const int64_t t1 = std::min(t0 + tile, n1);
      for (int64_t m0 = 0; m0 < M; m0 += kMaxRows) {
        const int64_t mb = std::min(kMaxRows, M - m0);
        range_fn(mb)(wp, ldw, xp + m0 * ldx, ldx, K, yp + m0 * N, N, t0, t1, m0 == 0 ? n1 : 0);
      }
    }
  });
  return y;
}

// x @ w^T through rows_f32 for up to max_rows rows, else through oneDNN's product with `packed` (w's packed
// twin, torch.ops.mkldnn._reorder_linear_weight): one op for a compiled step with a dynamic batch, which
// then needs no guard on the row count.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed, int64_t max_rows) {
  if (x.dim() == 2 && x.size(0) <= max_rows) return rows_f32(x, w);
  static const c10::OperatorHandle op =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x.contiguous(), packed, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  op.callBoxed(stack);
  return stack[0].toTensor();
}

}  // namespace
}  // namespace rsmem

#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif

// Implemented as explicit composites (a packed twin is an MkldnnCPU tensor; an implicit composite, what
// m.def with a function gives, may not have a fake), so that rsmem.models.ops.small_rows can give them fake
// implementations and compiled graphs call them as they are.
TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def("rows_f32(Tensor x, Tensor w) -> Tensor");
  m.def("rows_linear(Tensor x, Tensor w, Tensor packed, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(RSMEM_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("rows_f32", &rsmem::rows_f32);
  m.impl("rows_linear", &rsmem::rows_linear);
}
