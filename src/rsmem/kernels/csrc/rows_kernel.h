// Few-row products y = x @ w^T for x [M, K] float32 (M activation rows: a few sequences' tokens, up to the
// C++ steps' 64) and w [N, K] row-major, streaming w once, for weights of three element kinds (`W`): float32
// (rows_f32.cpp), and float16 or bfloat16 widened to float32 in registers as they are loaded (half_routes.h;
// F16C's vcvtph2ps, a bfloat16 is the high half of its float32). Sums are float32; only their order differs
// from x @ w^T in float32.
//
// A block of R output rows (R weight rows) meets every activation row: R x MB accumulators (MB <= 8 rows
// at a time) sit in registers, inner products run along K 16 (AVX-512) or 8 (AVX2) values at a time, the
// horizontal sums come once at the end of the block. The block's weight rows are read from memory once;
// a second group of activation rows (M > 8) reads them again from cache. The next block is prefetched
// while this one is multiplied; from 32 rows the later groups prefetch the next tile instead (Prefetch).
// A single activation row reads the weight rows as two streams instead, each row after the last (two_rows).
// Output row blocks are shared between rsmem's workers (pool::parallel_for), each thread with at least
// kMinBytesPerThread of weights (a second thread on a busy machine costs more than a small product saves).
// Without AVX2 (-march=x86-64-v2): a scalar loop, the same values.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Half.h>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "pool.h"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace rsmem {
namespace rows {

constexpr int64_t kMaxRows = 8;                  // activation rows per register group
constexpr int64_t kMinBytesPerThread = 1 << 20;  // weights a thread gets at least
constexpr int64_t kTile = 24;                    // output rows all groups meet before the next (M > 8)
constexpr int64_t kAhead = 2;                    // blocks ahead that the prefetch reads (into L2)

inline float f16_value(uint16_t h) { return c10::detail::fp16_ieee_to_fp32_value(h); }
inline float bf16_value(uint16_t h) {
  const uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using vec = __m512;
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline float vsum(vec a) { return _mm512_reduce_add_ps(a); }
#elif defined(__AVX2__)
constexpr int64_t kLanes = 8;
using vec = __m256;
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline float vsum(vec a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#endif

// The weight kinds: element type T, its float32 value (scalar), and, with AVX2 or AVX-512, kLanes of them
// widened into a register (load) and the first n < kLanes with zeros after them (tail).
struct F32W {
  using T = float;
  static float value(T v) { return v; }
#if defined(__AVX512F__)
  static vec load(const T* p) { return _mm512_loadu_ps(p); }
  static vec tail(const T* p, int64_t n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1u), p); }
#elif defined(__AVX2__)
  static vec load(const T* p) { return _mm256_loadu_ps(p); }
  static vec tail(const T* p, int64_t n) {
    alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(p, p + n, buf);
    return _mm256_load_ps(buf);
  }
#endif
};

struct F16W {
  using T = uint16_t;
  static float value(T v) { return f16_value(v); }
#if defined(__AVX512F__)
  static vec load(const T* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static vec tail(const T* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p));
  }
#elif defined(__AVX2__) && defined(__F16C__)
  static vec load(const T* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
  static vec tail(const T* p, int64_t n) {
    alignas(16) uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(p, p + n, buf);
    return load(buf);
  }
#elif defined(__AVX2__)
  static vec load(const T* p) {
    alignas(32) float buf[8];
    for (int i = 0; i < 8; ++i) buf[i] = f16_value(p[i]);
    return _mm256_load_ps(buf);
  }
  static vec tail(const T* p, int64_t n) {
    alignas(32) float buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t i = 0; i < n; ++i) buf[i] = f16_value(p[i]);
    return _mm256_load_ps(buf);
  }
#endif
};

struct BF16W {
  using T = uint16_t;
  static float value(T v) { return bf16_value(v); }
#if defined(__AVX512F__)
  static vec load(const T* p) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
  static vec tail(const T* p, int64_t n) {
    const __m512i v = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1u), p));
    return _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
  }
#elif defined(__AVX2__)
  static vec load(const T* p) {
    const __m256i v = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  }
  static vec tail(const T* p, int64_t n) {
    alignas(16) uint16_t buf[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    std::copy(p, p + n, buf);
    return load(buf);
  }
#endif
};

#if defined(__AVX512F__) || defined(__AVX2__)
// y[m, n0 + r] for r < R, m < MB: the weight rows w + (n0 + r) * ldw against the activation rows x + m * ldx.
// `next` (pf_rows rows of a later block, or null) is prefetched into L2 as this block goes: into L1, or just
// the next block, gains nothing; kAhead blocks ahead into L2 lets the loads overlap the multiply-adds.
// One cache line a row every 64 bytes.
// A single activation row (two_rows) is left to the hardware prefetcher: its loop is bound by memory, not by
// the multiply-adds, and the prefetches only add loads; from 4 rows on the multiply-adds are enough work for
// the prefetches to pay off (at 2 rows they are about even).
template <class W, int R, int MB>
inline void block(const typename W::T* __restrict w, int64_t ldw, const float* __restrict x, int64_t ldx,
                  int64_t K, float* __restrict y, int64_t ldy, const typename W::T* next, int64_t pf_rows,
                  bool add) {
  constexpr int64_t kLine = 64 / sizeof(typename W::T);  // elements a cache line
  vec acc[R][MB];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < MB; ++m) acc[r][m] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    if (next != nullptr && (k & (kLine - 1)) == 0)
      for (int64_t r = 0; r < pf_rows; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(next + r * ldw + k), _MM_HINT_T1);
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = W::load(w + r * ldw + k);
    for (int m = 0; m < MB; ++m) {
      vec xv = F32W::load(x + m * ldx + k);
      // in a register, loaded once: else the compiler folds the load into each of the R products (R loads
      // a vector, which on Zen 4 makes the loop bound by loads instead of multiply-adds)
      __asm__("" : "+v"(xv));
      for (int r = 0; r < R; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
    }
  }
  if (k < K) {
    const int64_t n = K - k;
    vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = W::tail(w + r * ldw + k, n);
    for (int m = 0; m < MB; ++m) {
      const vec xv = F32W::tail(x + m * ldx + k, n);
      for (int r = 0; r < R; ++r) acc[r][m] = vfma(wv[r], xv, acc[r][m]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) y[m * ldy + r] = add ? y[m * ldy + r] + vsum(acc[r][m]) : vsum(acc[r][m]);
}

// y[n] for n in [n0, n1): one activation row against two streams of weight rows, the range's first half and
// its second half in step (a row of each at a time, two accumulators a row), the odd row last.
// Two streams far apart keep more of memory's bandwidth than one, two neighbouring rows less, and three or
// four streams no more than two: a one-sequence decode step is faster with two.
template <class W>
inline void two_rows(const typename W::T* __restrict w, int64_t ldw, const float* __restrict x, int64_t K,
                     float* __restrict y, int64_t n0, int64_t n1) {
  const int64_t half = (n1 - n0) / 2, mid = n0 + half;
  // rows a and b of the weights (the odd last row: a == b, its sum written once); every row's sums are
  // taken in the same order whichever way the rows are shared between threads
  auto pair = [&](int64_t ra, int64_t rb) {
    const typename W::T* wa = w + ra * ldw;
    const typename W::T* wb = w + rb * ldw;
    vec a0 = vzero(), a1 = vzero(), b0 = vzero(), b1 = vzero();
    int64_t k = 0;
    for (; k + 2 * kLanes <= K; k += 2 * kLanes) {
      const vec x0 = F32W::load(x + k), x1 = F32W::load(x + k + kLanes);
      a0 = vfma(W::load(wa + k), x0, a0);
      b0 = vfma(W::load(wb + k), x0, b0);
      a1 = vfma(W::load(wa + k + kLanes), x1, a1);
      b1 = vfma(W::load(wb + k + kLanes), x1, b1);
    }
    if (k + kLanes <= K) {
      const vec x0 = F32W::load(x + k);
      a0 = vfma(W::load(wa + k), x0, a0);
      b0 = vfma(W::load(wb + k), x0, b0);
      k += kLanes;
    }
    if (k < K) {
      const vec x1 = F32W::tail(x + k, K - k);
      a1 = vfma(W::tail(wa + k, K - k), x1, a1);
      b1 = vfma(W::tail(wb + k, K - k), x1, b1);
    }
    y[ra] = vsum(vadd(a0, a1));
    y[rb] = vsum(vadd(b0, b1));
  };
  for (int64_t i = 0; i < half; ++i) pair(n0 + i, mid + i);
  if (mid + half < n1) pair(n1 - 1, n1 - 1);
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

// What a pass over rows [n0, n1) prefetches into L2 as it goes. `ahead`: its own blocks, kAhead ahead, below
// `end` (a pass that reads the weights from memory). Else rows [from, end) of the next tile, spread over the
// pass's blocks: with many groups of activation rows a pass that reads its tile from cache fetches a share
// of the next tile, a row a block, so that the next tile's first pass finds it in L2.
struct Prefetch {
  bool ahead = false;
  int64_t from = 0, end = 0;
};

// y[0:MB, n0:n1] (MB activation rows at x, y already offset to them): full blocks of R rows, then the
// remaining rows one at a time, prefetching as `pf` says.
template <class W, int MB>
void rows_range(const typename W::T* w, int64_t ldw, const float* x, int64_t ldx, int64_t K, float* y,
                int64_t ldy, int64_t n0, int64_t n1, Prefetch pf) {
#if defined(__AVX512F__) || defined(__AVX2__)
  if constexpr (MB == 1) {
    (void)ldx, (void)ldy, (void)pf;
    two_rows<W>(w, ldw, x, K, y, n0, n1);
  } else {
    constexpr int R = rows_for<MB>();
    // K in chunks whose activation rows stay in L1 (MB x KC floats of 16 KiB) when they would not
    const int64_t KC =
        MB * K * 4 > (24 << 10) ? std::max<int64_t>(kLanes, ((16 << 10) / (4 * MB)) & ~(kLanes - 1)) : K;
    const int64_t blocks = std::max<int64_t>(1, (n1 - n0) / R);
    const int64_t per_block = pf.ahead ? R : (pf.end - pf.from + blocks - 1) / blocks;
    for (int64_t k0 = 0; k0 < K; k0 += KC) {
      const int64_t kc = std::min(KC, K - k0);
      const bool add = k0 > 0;
      int64_t n = n0;
      for (int64_t j = 0; n + R <= n1; n += R, ++j) {
        const int64_t row = pf.ahead ? n + kAhead * R : pf.from + j * per_block;
        const int64_t rows = std::min(per_block, pf.end - row);
        const typename W::T* next = rows > 0 && (!pf.ahead || rows == R) ? w + row * ldw + k0 : nullptr;
        block<W, R, MB>(w + n * ldw + k0, ldw, x + k0, ldx, kc, y + n, ldy, next, rows, add);
      }
      for (; n < n1; ++n) block<W, 1, MB>(w + n * ldw + k0, ldw, x + k0, ldx, kc, y + n, ldy, nullptr, 0, add);
    }
  }
#else
  for (int64_t n = n0; n < n1; ++n)
    for (int m = 0; m < MB; ++m) {
      const typename W::T* wr = w + n * ldw;
      const float* xr = x + m * ldx;
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc += W::value(wr[k]) * xr[k];
      y[m * ldy + n] = acc;
    }
#endif
}

template <class W>
using RangeFn = void (*)(const typename W::T*, int64_t, const float*, int64_t, int64_t, float*, int64_t, int64_t,
                         int64_t, Prefetch);

template <class W>
RangeFn<W> range_fn(int64_t mb) {
  static constexpr RangeFn<W> table[kMaxRows] = {rows_range<W, 1>, rows_range<W, 2>, rows_range<W, 3>,
                                                 rows_range<W, 4>, rows_range<W, 5>, rows_range<W, 6>,
                                                 rows_range<W, 7>, rows_range<W, 8>};
  return table[mb - 1];
}

// Groups of activation rows from which the later groups prefetch the next tile (fewer: the first group's
// own prefetches, as for the first tile)
constexpr int64_t kSpreadFromGroups = 4;

// Rows [n0, n1) of y [M, N] (row stride N) = x [M, K] (row stride ldx) @ w [N, K]^T (row stride ldw) on this
// thread. Each output row's sums are taken in the same order whatever range it falls in.
template <class W>
void product_range(const float* x, int64_t ldx, const typename W::T* w, int64_t ldw, int64_t M, int64_t N,
                   int64_t K, float* y, int64_t n0, int64_t n1) {
  const int64_t groups = (M + kMaxRows - 1) / kMaxRows;
  const bool spread = groups >= kSpreadFromGroups;
  // one group of rows streams the whole range; more groups take it a tile at a time, the tile's weight
  // rows read from memory by the first group and from cache by the others
  const int64_t tile = groups == 1 ? n1 - n0 : kTile;
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(t0 + tile, n1), next_end = std::min(t1 + tile, n1);
    const int64_t share = groups == 1 ? 0 : (next_end - t1 + groups - 2) / (groups - 1);
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t m0 = g * kMaxRows, mb = std::min(kMaxRows, M - m0);
      Prefetch pf;  // none for a single row: its loop is bound by memory, the hardware prefetcher leads
      if (g == 0 && M > 1) {
        pf.ahead = true;
        pf.end = !spread ? n1 : t0 == n0 ? t1 : 0;
      } else if (g > 0 && spread) {
        pf.from = std::min(t1 + (g - 1) * share, next_end);
        pf.end = std::min(pf.from + share, next_end);
      }
      range_fn<W>(mb)(w, ldw, x + m0 * ldx, ldx, K, y + m0 * N, N, t0, t1, pf);
    }
  }
}

// y [M, N] (row stride N) = x [M, K] (row stride ldx) @ w [N, K]^T (row stride ldw), M, N, K > 0.
template <class W>
void product(const float* x, int64_t ldx, const typename W::T* w, int64_t ldw, int64_t M, int64_t N, int64_t K,
             float* y) {
  const int64_t grain =
      std::max<int64_t>(16, kMinBytesPerThread / (static_cast<int64_t>(sizeof(typename W::T)) * K));
  pool::parallel_for(0, N, grain,
                     [&](int64_t n0, int64_t n1) { product_range<W>(x, ldx, w, ldw, M, N, K, y, n0, n1); });
}

// One of products()'s float32 products: y [M, N] (row stride N) = x [M, K] (row stride ldx) @ w [N, K]^T
// (row stride ldw)
struct Job {
  const float* x;
  int64_t ldx;
  const float* w;
  int64_t ldw, N, K;
  float* y;
};

// Independent products of the same M activation rows in one parallel region: their weights' values laid end
// to end and shared between rsmem's workers (row r of job j goes to the range holding its first value),
// so that small products (a low-rank matrix's 200 KB) run on every thread beside the big ones instead of on
// one thread each, and a step hands off once for them all. Each row's sums are product()'s.
inline void products(const std::vector<Job>& jobs, int64_t M) {
  std::vector<int64_t> start(jobs.size() + 1, 0);
  for (size_t j = 0; j < jobs.size(); ++j) start[j + 1] = start[j] + jobs[j].N * jobs[j].K;
  const int64_t grain = kMinBytesPerThread / static_cast<int64_t>(sizeof(float));
  pool::parallel_for(0, start.back(), grain, [&](int64_t b0, int64_t b1) {
    for (size_t j = 0; j < jobs.size(); ++j) {
      const Job& jb = jobs[j];
      // the rows whose first value lies in [b0, b1)
      const int64_t lo = std::clamp<int64_t>((b0 - start[j] + jb.K - 1) / jb.K, 0, jb.N);
      const int64_t hi = std::clamp<int64_t>((b1 - start[j] + jb.K - 1) / jb.K, 0, jb.N);
      if (lo < hi) product_range<F32W>(jb.x, jb.ldx, jb.w, jb.ldw, M, jb.N, jb.K, jb.y, lo, hi);
    }
  });
}

// x [M, K] @ w^T through oneDNN's product with `packed`, w's packed twin (torch.ops.mkldnn's
// _reorder_linear_weight): the route beyond the rows this kernel is for
inline at::Tensor packed_product(const at::Tensor& x, const at::Tensor& packed) {
  static const c10::OperatorHandle linear =
      c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  std::vector<c10::IValue> stack{x.contiguous(), packed, c10::IValue(), std::string("none"),
                                 c10::List<std::optional<at::Scalar>>(), c10::IValue()};
  linear.callBoxed(stack);
  return stack[0].toTensor();
}

// x [M, K] @ w^T for w [N, K] given as oneDNN packed slices of its rows (slices[s] the next rows after
// slices[s - 1]'s): the slices are shared between rsmem's workers, each running oneDNN's product on one
// OpenMP thread (oneDNN's own two OpenMP threads sleep between products: rsmem's passive wait policy). The
// RWKV steps take it from 32 rows (rsmem.models.step.native.SLICED_FROM_ROWS).
inline at::Tensor sliced_product(const at::Tensor& x_in, at::TensorList slices, int64_t N) {
  // this thread's OpenMP setting at one thread while it lives (a thread's own; the one before restored)
  struct OneOpenMPThread {
#if defined(_OPENMP)
    const int before = omp_get_max_threads();
    OneOpenMPThread() { omp_set_num_threads(1); }
    ~OneOpenMPThread() { omp_set_num_threads(before); }
#endif
  };
  const at::Tensor x = x_in.contiguous();
  const int64_t M = x.size(0), S = static_cast<int64_t>(slices.size());
  std::vector<int64_t> start(S + 1, 0);
  for (int64_t s = 0; s < S; ++s) start[s + 1] = start[s] + slices[s].size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  float* yp = y.data_ptr<float>();
  pool::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    const OneOpenMPThread one;
    for (int64_t s = s0; s < s1; ++s) {
      const at::Tensor part = packed_product(x, slices[s]);
      const float* pp = part.data_ptr<float>();
      const int64_t n = start[s + 1] - start[s];
      for (int64_t m = 0; m < M; ++m) std::memcpy(yp + m * N + start[s], pp + m * n, n * sizeof(float));
    }
  });
  return y;
}

}  // namespace rows
}  // namespace rsmem
