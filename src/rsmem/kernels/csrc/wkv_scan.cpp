// RWKV's WKV recurrences over a prompt, token by token in C++: each (sequence, head) keeps its [N, N]
// state in L1 (16 KiB at head size 64) for the whole prompt, and the heads are shared between rsmem's
// workers (pool.h).
//
//   wkv7_scan(state [Bs, H, N(v), N(k)], r, log_w, k, v, a, b [Bs, L, H, N]) -> y [Bs, L, H, N]
//       per token: S = S diag(exp(log_w)) + (S a) b^T + v k^T, y = S r (rsmem.models.ops.wkv)
//   wkv6_scan(state [Bs, H, N(k), N(v)], r, log_w, k, v [Bs, L, H, N], u [H, N]) -> y [Bs, L, H, N]
//       per token: y = S^T r + (r . u k) v, then S = diag(exp(log_w)) S + k v^T (rsmem.models.ops.wkv6)
//
// The state is updated in place. The chunked kernels (parallel within a chunk: their products are
// [T, T] and [T, N] matrices) did the same work as ~80 library calls a chunk and layer, whose overhead
// made up a large share of a prompt's time. Reference twins: wkv7_ref_ and wkv6_ref_, the
// one-token steps in a loop (tests/rwkv/test_wkv_scan.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <array>
#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "pool.h"
#include "vec_math.h"
#include "wkv_token.h"

namespace rsmem {
namespace {

constexpr int64_t kMaxHead = 256;

// w[j] = exp(log_w[j]) for n values
inline void decay(const float* __restrict log_w, float* __restrict w, int64_t n) {
  int64_t j = 0;
#if defined(__AVX512F__)
  for (; j + 16 <= n; j += 16) _mm512_storeu_ps(w + j, exp16(_mm512_loadu_ps(log_w + j)));
#endif
  for (; j < n; ++j) w[j] = std::exp(log_w[j]);
}

// the checks both scans share; returns {Bs, L, H, N}
std::array<int64_t, 4> check(const char* op, const at::Tensor& state, std::initializer_list<const at::Tensor*> xs) {
  const at::Tensor& r = **xs.begin();
  TORCH_CHECK_VALUE(r.dim() == 4, op, ": inputs must be [Bs, L, H, N], got ", r.sizes());
  const int64_t Bs = r.size(0), L = r.size(1), H = r.size(2), N = r.size(3);
  TORCH_CHECK_VALUE(N >= 1 && N <= kMaxHead, op, ": head size ", N, " is not in 1..", kMaxHead);
  for (const at::Tensor* t : xs) {
    TORCH_CHECK_VALUE(t->scalar_type() == at::kFloat && t->device().is_cpu() && t->is_contiguous() &&
                          t->sizes() == r.sizes(),
                      op, ": every input must be a contiguous float32 CPU tensor ", r.sizes(), ", got ",
                      t->scalar_type(), " ", t->sizes());
  }
  TORCH_CHECK_VALUE(state.scalar_type() == at::kFloat && state.device().is_cpu() && state.is_contiguous() &&
                        state.dim() == 4 && state.size(0) == Bs && state.size(1) == H && state.size(2) == N &&
                        state.size(3) == N,
                    op, ": state must be a contiguous float32 CPU tensor [", Bs, ", ", H, ", ", N, ", ", N,
                    "], got ", state.scalar_type(), " ", state.sizes());
  return {Bs, L, H, N};
}

at::Tensor wkv7_scan(at::Tensor state, const at::Tensor& r, const at::Tensor& log_w, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& a, const at::Tensor& b) {
  const auto [Bs, L, H, N] = check("wkv7_scan", state, {&r, &log_w, &k, &v, &a, &b});
  at::Tensor y = at::empty_like(r);
  const float *rp = r.data_ptr<float>(), *lp = log_w.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *vp = v.data_ptr<float>(), *ap = a.data_ptr<float>(), *bp = b.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  pool::parallel_for(0, Bs * H, 1, [&](int64_t i0, int64_t i1) {
    float w[kMaxHead];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / H, h = i % H;
      float* st = sp + i * N * N;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t off = ((s * L + t) * H + h) * N;
        decay(lp + off, w, N);
        wkv::token7(st, rp + off, w, kp + off, vp + off, ap + off, bp + off, yp + off, N);
      }
    }
  });
  return y;
}

at::Tensor wkv6_scan(at::Tensor state, const at::Tensor& r, const at::Tensor& log_w, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& u) {
  const auto [Bs, L, H, N] = check("wkv6_scan", state, {&r, &log_w, &k, &v});
  TORCH_CHECK_VALUE(u.scalar_type() == at::kFloat && u.is_contiguous() && u.numel() == H * N,
                    "wkv6_scan: u must be a contiguous float32 [", H, ", ", N, "], got ", u.scalar_type(), " ",
                    u.sizes());
  at::Tensor y = at::empty_like(r);
  const float *rp = r.data_ptr<float>(), *lp = log_w.data_ptr<float>(), *kp = k.data_ptr<float>();
  const float *vp = v.data_ptr<float>(), *up = u.data_ptr<float>();
  float *sp = state.data_ptr<float>(), *yp = y.data_ptr<float>();
  pool::parallel_for(0, Bs * H, 1, [&](int64_t i0, int64_t i1) {
    float w[kMaxHead];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t s = i / H, h = i % H;
      float* st = sp + i * N * N;
      const float* uh = up + h * N;
      for (int64_t t = 0; t < L; ++t) {
        const int64_t off = ((s * L + t) * H + h) * N;
        decay(lp + off, w, N);
        wkv::token6(st, rp + off, w, kp + off, vp + off, uh, yp + off, N);
      }
    }
  });
  return y;
}

}  // namespace
}  // namespace rsmem

#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def("wkv7_scan(Tensor(a!) state, Tensor r, Tensor log_w, Tensor k, Tensor v, Tensor a, Tensor b) -> Tensor",
        &rsmem::wkv7_scan);
  m.def("wkv6_scan(Tensor(a!) state, Tensor r, Tensor log_w, Tensor k, Tensor v, Tensor u) -> Tensor",
        &rsmem::wkv6_scan);
}
