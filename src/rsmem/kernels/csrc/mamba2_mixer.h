// Mamba-2's mixer between its two projections for one token of each of Bs sequences, shared by the C++
// decode steps (mamba2_step.cpp, hybrid_step.cpp): the short convolution and SiLU of the xBC channels,
// dt = softplus(dt + dt_bias), per head h = h exp(dt A) + (x dt) B^T and y = h C + D x (the state after the
// token, as llama.cpp's ssm_scan), then the gated group RMS norm of y with z. Heads of every sequence are
// shared between rsmem's product workers (pool.h).
#pragma once

#include <ATen/ATen.h>

#include <algorithm>
#include <cmath>

#include "pool.h"
#include "step_common.h"
#include "vec_math.h"

namespace rsmem {
namespace step {

// The mixer's tensors but its input, checked before anything is written: h [Bs, H, P, N]; returns the width
// of in_proj's output (z, xBC, dt) that goes with them.
inline int64_t check_mixer(const char* op, const at::Tensor& window, const at::Tensor& conv_weight, const at::Tensor& conv_bias,
                    const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D, const at::Tensor& ssm_norm,
                    const at::Tensor& h, int64_t n_group) {
  TORCH_CHECK_VALUE(h.dim() == 4, op, ": h must be [Bs, H, P, N], got ", h.sizes());
  const int64_t Bs = h.size(0), H = h.size(1), P = h.size(2), N = h.size(3), d_inner = H * P;
  TORCH_CHECK_VALUE(n_group > 0 && H % n_group == 0, op, ": n_group must divide the heads");
  TORCH_CHECK_VALUE(conv_weight.dim() == 2, op, ": conv_weight must be [conv_dim, K]");
  const int64_t C = conv_weight.size(0), K = conv_weight.size(1);
  TORCH_CHECK_VALUE(C == d_inner + 2 * n_group * N && K >= 2, op, ": conv_weight ", conv_weight.sizes(),
                    " does not fit h ", h.sizes(), " and ", n_group, " groups");
  check_f32(op, h, Bs * H * P * N, "h");
  check_f32(op, window, Bs * C * (K - 1), "window");
  check_f32(op, conv_weight, C * K, "conv_weight");
  check_f32(op, conv_bias, C, "conv_bias");
  check_f32(op, dt_bias, H, "dt_bias");
  check_f32(op, A, H, "A");
  check_f32(op, D, H, "D");
  check_f32(op, ssm_norm, d_inner, "ssm_norm");
  return d_inner + C + H;
}

// the mixer on checked operands (check_mixer)
inline at::Tensor mixer(const at::Tensor& zxbcdt, at::Tensor& window, const at::Tensor& conv_weight,
                 const at::Tensor& conv_bias, const at::Tensor& dt_bias, const at::Tensor& A, const at::Tensor& D,
                 const at::Tensor& ssm_norm, at::Tensor& h, int64_t n_group, double eps) {
  const int64_t Bs = h.size(0), H = h.size(1), P = h.size(2), N = h.size(3), d_inner = H * P;
  const int64_t C = conv_weight.size(0), K = conv_weight.size(1);
  const int64_t G = n_group, rep = H / G, Dg = d_inner / G;
  at::Tensor xbc = at::empty({Bs, C}, zxbcdt.options());     // after the conv and SiLU
  at::Tensor y = at::empty({Bs, d_inner}, zxbcdt.options());  // before the norm
  at::Tensor dts = at::empty({Bs, H}, zxbcdt.options());
  const float *zp = zxbcdt.data_ptr<float>(), *cw = conv_weight.data_ptr<float>(), *cb = conv_bias.data_ptr<float>();
  const float *dtb = dt_bias.data_ptr<float>(), *Ap = A.data_ptr<float>(), *Dp = D.data_ptr<float>();
  const float* nw = ssm_norm.data_ptr<float>();
  float *win = window.data_ptr<float>(), *xp = xbc.data_ptr<float>(), *yp = y.data_ptr<float>();
  float *hp = h.data_ptr<float>(), *dtp = dts.data_ptr<float>();
  const int64_t ld = zxbcdt.stride(0);
  for (int64_t b = 0; b < Bs; ++b) {
    const float* row = zp + b * ld;
    step::conv_silu_token(row + d_inner, win + b * C * (K - 1), cw, cb, xp + b * C, C, K);
    for (int64_t hh = 0; hh < H; ++hh) dtp[b * H + hh] = softplus(row[d_inner + C + hh] + dtb[hh]);
  }
  // heads of every sequence, each state row updated and read once: h = h dA + (x dt) B; y = h . C + D x
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (P * N));
  pool::parallel_for(0, Bs * H, grain, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / H, hh = i % H, g = hh / rep;
      const float dt = dtp[i], dA = std::exp(dt * Ap[hh]), d = Dp[hh];
      const float* x = xp + b * C + hh * P;
      const float* B = xp + b * C + d_inner + g * N;
      const float* Cv = xp + b * C + d_inner + G * N + g * N;
      float* st = hp + i * P * N;
      float* yo = yp + b * d_inner + hh * P;
      for (int64_t p = 0; p < P; ++p) yo[p] = update_row(st + p * N, B, Cv, N, dA, x[p] * dt) + d * x[p];
    }
  });
  // gated group RMS norm: g = y * silu(z), each group scaled by 1 / rms, times the norm's weight
  at::Tensor out = at::empty({Bs, d_inner}, zxbcdt.options());
  float* op = out.data_ptr<float>();
  for (int64_t b = 0; b < Bs; ++b) {
    for (int64_t g = 0; g < G; ++g) {
      const int64_t off = b * d_inner + g * Dg;
      float* og = op + off;
      const float ss = gate_row(yp + off, zp + b * ld + g * Dg, og, Dg);
      const float scale = 1.f / std::sqrt(ss / static_cast<float>(Dg) + static_cast<float>(eps));
      for (int64_t j = 0; j < Dg; ++j) og[j] = og[j] * scale * nw[g * Dg + j];
    }
  }
  return out;
}

}  // namespace step
}  // namespace rsmem
