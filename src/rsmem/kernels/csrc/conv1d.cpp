// The short causal depthwise convolution of Mamba, Mamba-2 and the hybrids' recurrent layers, for a prompt:
// one pass that reads the in_proj slice where it lies and writes a contiguous output, instead of torch's
// transposed concatenation, grouped conv1d and transposed result (three strided copies of the tensor).
//
//   x [Bs, L, C] float32 with unit stride over C (a column slice of a wider tensor is fine);
//   window [Bs, C, K-1] float32 contiguous: the K-1 inputs before x, updated in place to the last K-1;
//   weight [C, K] float32 (column K-1 multiplies the current token); bias [C] or an empty tensor.
//   Returns y [Bs, L, C] contiguous: y[b, t, c] = bias[c] + sum_k weight[c, k] * in(b, t - (K-1) + k, c),
//   where in(b, s, c) is x[b, s, c] for s >= 0 and window[b, c, K-1+s] before it. No activation: torch's
//   vectorised silu on the contiguous result beats a scalar one fused here.
//
// Threaded with at::parallel_for over (sequence, block of tokens); the window moves after every output
// is written. Its reference twin is rsmem.models.ops.conv.causal_conv1d_ (tests/kernels/test_conv1d.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

namespace rsmem {
namespace {

constexpr int64_t kTokenBlock = 16;

at::Tensor conv1d_causal_(const at::Tensor& x, at::Tensor& window, const at::Tensor& weight_,
                          const at::Tensor& bias_) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 3 && x.stride(2) == 1,
              "conv1d_causal_: x must be float32 [Bs, L, C] with unit stride over C");
  TORCH_CHECK(window.scalar_type() == at::kFloat && window.dim() == 3 && window.is_contiguous(),
              "conv1d_causal_: window must be contiguous float32 [Bs, C, K-1]");
  const int64_t Bs = x.size(0), L = x.size(1), C = x.size(2), K1 = window.size(2), K = K1 + 1;
  TORCH_CHECK(window.size(0) == Bs && window.size(1) == C, "conv1d_causal_: window shape");
  TORCH_CHECK(weight_.scalar_type() == at::kFloat && weight_.dim() == 2 && weight_.size(0) == C &&
                  weight_.size(1) == K,
              "conv1d_causal_: weight must be float32 [C, K]");
  const bool has_bias = bias_.numel() > 0;
  TORCH_CHECK(!has_bias || (bias_.scalar_type() == at::kFloat && bias_.numel() == C), "conv1d_causal_: bias [C]");
  TORCH_CHECK(x.stride(1) >= C || L <= 1, "conv1d_causal_: overlapping token rows");

  // [K, C] so that the inner loop runs over contiguous channels for every tap
  const at::Tensor wt = weight_.t().contiguous();
  const at::Tensor bias = has_bias ? bias_.contiguous() : at::zeros({C}, x.options());
  // [Bs, K-1, C]: the window's inputs as token rows, read by the first K-1 outputs of each sequence
  const at::Tensor head = window.transpose(1, 2).contiguous();
  at::Tensor y = at::empty({Bs, L, C}, x.options());
  const float *xp = x.data_ptr<float>(), *wp = wt.data_ptr<float>(), *bp = bias.data_ptr<float>();
  const float* hp = head.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t sb = x.stride(0), st = x.stride(1);
  const int64_t n_blocks = (L + kTokenBlock - 1) / kTokenBlock;

  at::parallel_for(0, Bs * n_blocks, 1, [&](int64_t i0, int64_t i1) {
    std::vector<const float*> rows(K);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / n_blocks, t0 = (i % n_blocks) * kTokenBlock, t1 = std::min(L, t0 + kTokenBlock);
      for (int64_t t = t0; t < t1; ++t) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t s = t - K1 + k;
          rows[k] = s >= 0 ? xp + b * sb + s * st : hp + (b * K1 + K1 + s) * C;
        }
        float* out = yp + (b * L + t) * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) out[c] = bp[c];
        for (int64_t k = 0; k < K; ++k) {
          const float* in = rows[k];
          const float* w = wp + k * C;
#pragma omp simd
          for (int64_t c = 0; c < C; ++c) out[c] += w[c] * in[c];
        }
      }
    }
  });

  // the window after x: its last K-1 inputs (some from the old window when L < K-1)
  float* wnd = window.data_ptr<float>();
  for (int64_t b = 0; b < Bs; ++b) {
    for (int64_t j = 0; j < K1; ++j) {
      const int64_t s = L - K1 + j;  // the input that becomes column j
      const float* src = s >= 0 ? xp + b * sb + s * st : hp + (b * K1 + K1 + s) * C;
      for (int64_t c = 0; c < C; ++c) wnd[(b * C + c) * K1 + j] = src[c];
    }
  }
  return y;
}

}  // namespace
}  // namespace rsmem

#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def("conv1d_causal_(Tensor x, Tensor(a!) window, Tensor weight, Tensor bias) -> Tensor",
        &rsmem::conv1d_causal_);
}
