// RMS norms of a prompt in one pass: Mamba-2's gated output norm (g = y * silu(z), then each group of g
// divided by its RMS and multiplied by the weight) and, with no z, the plain pre-norm of every layer. torch
// runs them as five to seven elementwise and reduction kernels over the tensor, each a parallel region of
// its own; here it is one, reading y and z where they lie.
//
//   y [Bs, L, D], z [Bs, L, D] or an empty tensor (no gate), float32 with unit stride over D and token rows
//   evenly spaced (a column slice of a wider tensor is fine); weight [D]; n_group divides D. Returns out
//   [Bs, L, D] contiguous: out[r, g*Dg + j] = gz[j] / sqrt(mean(gz^2) + eps) * weight[g*Dg + j], with
//   gz = (y * silu(z))[r, g*Dg ...] (y itself without z).
//
// silu's exponential is a Cephes-style polynomial (AVX-512 where compiled for it, else std::exp), ~1 ulp.
// Threaded with at::parallel_for over rows. Its reference twin is
// rsmem.models.ops.norm.gated_group_rms_norm's torch form (tests/kernels/test_gated_norm.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>

#include "vec_math.h"

namespace rsmem {
namespace {

// the spacing of the token rows of a [Bs, L, D] tensor with unit stride over D, else -1 (not evenly spaced)
int64_t row_stride(const at::Tensor& t) {
  if (t.dim() != 3 || t.stride(2) != 1) return -1;
  const int64_t Bs = t.size(0), L = t.size(1);
  if (L > 1) return (Bs == 1 || t.stride(0) == L * t.stride(1)) ? t.stride(1) : -1;
  return Bs > 1 ? t.stride(0) : t.size(2);
}

at::Tensor gated_rms_norm(const at::Tensor& y, const at::Tensor& z, const at::Tensor& weight_, int64_t n_group,
                          double eps) {
  const bool gated = z.numel() > 0;
  TORCH_CHECK(y.scalar_type() == at::kFloat && z.scalar_type() == at::kFloat, "gated_rms_norm: float32 y, z");
  TORCH_CHECK(y.dim() == 3 && (!gated || y.sizes() == z.sizes()),
              "gated_rms_norm: y and z must be [Bs, L, D] alike");
  const int64_t Bs = y.size(0), L = y.size(1), D = y.size(2), rows = Bs * L;
  TORCH_CHECK(n_group > 0 && D % n_group == 0, "gated_rms_norm: n_group must divide D");
  TORCH_CHECK(weight_.scalar_type() == at::kFloat && weight_.numel() == D, "gated_rms_norm: weight [D]");
  const int64_t sy = row_stride(y), sz = gated ? row_stride(z) : D;
  TORCH_CHECK(sy >= D && sz >= D, "gated_rms_norm: rows must have unit stride over D and even spacing");
  const at::Tensor weight = weight_.contiguous();
  at::Tensor out = at::empty({Bs, L, D}, y.options());
  const float *yp = y.data_ptr<float>(), *zp = gated ? z.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t Dg = D / n_group;
  const float feps = static_cast<float>(eps);
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / D);

  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      float* o = op + r * D;
      for (int64_t g = 0; g < n_group; ++g) {
        const int64_t off = g * Dg;
        const float ss = gate_row(yp + r * sy + off, gated ? zp + r * sz + off : nullptr, o + off, Dg);
        const float scale = 1.f / std::sqrt(ss / static_cast<float>(Dg) + feps);
        const float* w = wp + off;
        float* og = o + off;
#pragma omp simd
        for (int64_t j = 0; j < Dg; ++j) og[j] = og[j] * scale * w[j];
      }
    }
  });
  return out;
}

}  // namespace
}  // namespace rsmem

#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def("gated_rms_norm(Tensor y, Tensor z, Tensor weight, int n_group, float eps) -> Tensor",
        &rsmem::gated_rms_norm);
}
