// Mamba-2's state scan (SSD) token by token, as llama.cpp's ggml_ssm_scan runs it: for a model whose
// state fits in cache the recurrence costs H * P * N multiply-adds a token, less than the chunked form's
// masked products and the memory traffic of its intermediate tensors.
//
//   x [Bs, L, H, P], dt [Bs, L, H] (after softplus), A [H], B, C [Bs, L, G, N], D [H], all float32;
//   h [Bs, H, P, N] float32 contiguous, updated in place to the state after the last token;
//   at_b, at_t int64 [K]: points (sequence b after its token t) whose states go to the returned
//   h_at [K, H, P, N]. Returns (y [Bs, L, H, P], h_at).
//
// Per (sequence, head), threaded with at::parallel_for: dA = exp(dt A); h = h dA + (x dt) B^T;
// y = h C + D x. Its reference twin is rsmem.models.ops.ssd.ssd_ref (tests/kernels/test_ssd_scan.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <tuple>
#include <vector>

#include "vec_math.h"

namespace rsmem {
namespace {

std::tuple<at::Tensor, at::Tensor> ssd_scan_(const at::Tensor& x_, const at::Tensor& dt_, const at::Tensor& A_,
                                             const at::Tensor& B_, const at::Tensor& C_, const at::Tensor& D_,
                                             at::Tensor h, const at::Tensor& at_b, const at::Tensor& at_t) {
  TORCH_CHECK(h.scalar_type() == at::kFloat && h.is_contiguous() && h.dim() == 4, "h: contiguous float32 4-D");
  const at::Tensor x = x_.contiguous(), dt = dt_.contiguous(), A = A_.contiguous();
  const at::Tensor B = B_.contiguous(), C = C_.contiguous(), D = D_.contiguous();
  for (const at::Tensor* t : {&x, &dt, &A, &B, &C, &D})
    TORCH_CHECK(t->scalar_type() == at::kFloat, "ssd_scan_: float32 inputs");
  TORCH_CHECK(x.dim() == 4 && dt.dim() == 3 && B.dim() == 4 && C.sizes() == B.sizes(), "ssd_scan_: shapes");
  const int64_t Bs = x.size(0), L = x.size(1), H = x.size(2), P = x.size(3);
  const int64_t G = B.size(2), N = B.size(3);
  TORCH_CHECK(dt.size(0) == Bs && dt.size(1) == L && dt.size(2) == H, "ssd_scan_: dt shape");
  TORCH_CHECK(B.size(0) == Bs && B.size(1) == L && G > 0 && H % G == 0, "ssd_scan_: B/C shape");
  TORCH_CHECK(A.numel() == H && D.numel() == H, "ssd_scan_: A/D shape");
  TORCH_CHECK(h.size(0) == Bs && h.size(1) == H && h.size(2) == P && h.size(3) == N, "ssd_scan_: h shape");
  TORCH_CHECK(at_b.scalar_type() == at::kLong && at_t.scalar_type() == at::kLong && at_b.numel() == at_t.numel(),
              "ssd_scan_: capture points");
  const int64_t K = at_b.numel();
  // capture points by sequence: token -> index into h_at (tokens in increasing order)
  std::vector<std::vector<std::pair<int64_t, int64_t>>> points(Bs);
  const int64_t* pb = at_b.data_ptr<int64_t>();
  const int64_t* pt = at_t.data_ptr<int64_t>();
  for (int64_t i = 0; i < K; ++i) {
    TORCH_CHECK(pb[i] >= 0 && pb[i] < Bs && pt[i] >= 0 && pt[i] < L, "ssd_scan_: capture point out of range");
    points[pb[i]].emplace_back(pt[i], i);
  }
  for (auto& p : points) std::sort(p.begin(), p.end());

  at::Tensor y = at::empty({Bs, L, H, P}, x.options());
  at::Tensor h_at = at::empty({K, H, P, N}, h.options());
  const float *xp = x.data_ptr<float>(), *dtp = dt.data_ptr<float>(), *Ap = A.data_ptr<float>();
  const float *Bp = B.data_ptr<float>(), *Cp = C.data_ptr<float>(), *Dp = D.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *yp = y.data_ptr<float>(), *hatp = h_at.data_ptr<float>();
  const int64_t rep = H / G, state = P * N;
  const int64_t grain = std::max<int64_t>(1, (1 << 15) / std::max<int64_t>(1, L * state / 64));

  at::parallel_for(0, Bs * H, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, hd = i % H, g = hd / rep;
      float* hs = hp + i * state;
      const float a = Ap[hd], d = Dp[hd];
      size_t next = 0;
      const auto& pts = points[b];
      for (int64_t t = 0; t < L; ++t) {
        const int64_t bt = b * L + t;
        const float dtv = dtp[bt * H + hd];
        const float dA = std::exp(dtv * a);
        const float* Bt = Bp + (bt * G + g) * N;
        const float* Ct = Cp + (bt * G + g) * N;
        const float* xt = xp + (bt * H + hd) * P;
        float* yt = yp + (bt * H + hd) * P;
        for (int64_t p = 0; p < P; ++p) yt[p] = update_row(hs + p * N, Bt, Ct, N, dA, xt[p] * dtv) + d * xt[p];
        while (next < pts.size() && pts[next].first == t) {
          std::copy(hs, hs + state, hatp + (pts[next].second * H + hd) * state);
          ++next;
        }
      }
    }
  });
  return {y, h_at};
}

}  // namespace
}  // namespace rsmem

#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def(
      "ssd_scan_(Tensor x, Tensor dt, Tensor A, Tensor B, Tensor C, Tensor D, Tensor(a!) h, Tensor at_b, "
      "Tensor at_t) -> (Tensor, Tensor)",
      &rsmem::ssd_scan_);
}
