// Mamba-2's one-token decode step in C++: one op call a token (of one or a few sequences) instead of a
// compiled graph whose Python wrapper, dynamo guards and ~100 small buffers cost a large share of a
// small model's token (the products themselves stream the weights at the machine's read rate).
//
//   mamba2_mixer_one_(zxbcdt [Bs, d_inner + conv_dim + H], window [Bs, conv_dim, K-1] (moved in place),
//       conv_weight [conv_dim, K], conv_bias [conv_dim], dt_bias, A, D [H], ssm_norm [d_inner],
//       h [Bs, H, P, N] (updated in place), n_group, eps) -> y [Bs, d_inner]
//     the mixer between the two projections: the short convolution and SiLU of the xBC channels,
//     dt = softplus(dt + dt_bias), per head h = h exp(dt A) + (x dt) B^T and y = h C + D x (the state after
//     the token, as llama.cpp's ssm_scan), then the gated group RMS norm of y with z. Heads are shared
//     between rsmem's product workers (pool.h), so the state update (196,608 floats a layer at 130M) reads
//     and writes each state row once, on both cores.
//   mamba2_step(x [M, d_model], layers: 11 tensors a layer (Mamba2Field: norm, in_proj, conv_weight, conv_bias,
//       dt_bias, A, D, ssm_norm, out_proj, window [M, ...], h [M, H, P, N]), qtypes [2 a layer (Mamba2Matrix):
//       in_proj, out_proj], norm_f, head, head_qtype, n_group, eps) -> logits [M, n_vocab]
//     the whole step: per layer the pre-norm, in_proj, the mixer, out_proj and the residual; then the final
//     norm and the head. A matrix of qtype -1 is float32 [out, in] with contiguous rows (the few-row kernel,
//     rows_kernel.h); another qtype is blocks for rsmem_native::qmatmul (Q8_0, Q4_K, ..., F16, BF16).
//
// Reference twins: rsmem.models.step.fused.mamba2_mixer_step_ and token_step (mamba2_layer_one_), the
// compiled step's own function (tests/kernels/test_mamba2_step.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "mamba2_mixer.h"
#include "step_common.h"

namespace rsmem {
namespace {

using step::check_f32;
using step::check_mixer;
using step::mixer;
using step::check_matrix;
using step::Mamba2Field;
using step::Mamba2Matrix;
using step::product;
using step::rms_norm_rows;
using step::softplus;

constexpr const char* kOp = "mamba2 step";

at::Tensor mamba2_mixer_one_(const at::Tensor& zxbcdt, at::Tensor& window, const at::Tensor& conv_weight,
                             const at::Tensor& conv_bias, const at::Tensor& dt_bias, const at::Tensor& A,
                             const at::Tensor& D, const at::Tensor& ssm_norm, at::Tensor& h, int64_t n_group,
                             double eps) {
  const int64_t width = check_mixer(kOp, window, conv_weight, conv_bias, dt_bias, A, D, ssm_norm, h, n_group);
  TORCH_CHECK_VALUE(zxbcdt.scalar_type() == at::kFloat && zxbcdt.dim() == 2 && zxbcdt.size(0) == h.size(0) &&
                        zxbcdt.size(1) == width && zxbcdt.stride(1) == 1,
                    "mamba2 step: zxbcdt must be float32 [", h.size(0), ", ", width, "] with unit stride, got ",
                    zxbcdt.sizes());
  return mixer(zxbcdt, window, conv_weight, conv_bias, dt_bias, A, D, ssm_norm, h, n_group, eps);
}

constexpr int64_t kLayerTensors = Mamba2Field::N_FIELDS;
constexpr int64_t kQtypes = Mamba2Matrix::N_MATRICES;

at::Tensor mamba2_step(const at::Tensor& x_in, at::TensorList layers, at::IntArrayRef qtypes,
                       const at::Tensor& norm_f, const at::Tensor& head, int64_t head_qtype, int64_t n_group,
                       double eps) {
  TORCH_CHECK_VALUE(layers.size() % kLayerTensors == 0 && qtypes.size() * kLayerTensors == kQtypes * layers.size(),
                    "mamba2 step: ", kLayerTensors, " tensors and ", kQtypes, " qtypes a layer, got ", layers.size(),
                    " and ", qtypes.size());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(0) >= 1,
                    "mamba2 step: x must be float32 [M, d_model], got ", x_in.sizes());
  const int64_t M = x_in.size(0), dm = x_in.size(1);
  const int64_t n_layer = static_cast<int64_t>(layers.size()) / kLayerTensors;
  // every layer's operands first: a bad one is an error before any state is written
  for (int64_t il = 0; il < n_layer; ++il) {
    const at::Tensor* t = layers.data() + il * kLayerTensors;
    const int64_t* q = qtypes.data() + il * kQtypes;
    const at::Tensor& h = t[Mamba2Field::H];
    check_f32(kOp, t[Mamba2Field::NORM], dm, "norm");
    TORCH_CHECK_VALUE(h.dim() == 4 && h.size(0) == M, "mamba2 step: h must be [", M, ", H, P, N], got ", h.sizes());
    const int64_t width = check_mixer(kOp, t[Mamba2Field::WINDOW], t[Mamba2Field::CONV_WEIGHT],
                                      t[Mamba2Field::CONV_BIAS], t[Mamba2Field::DT_BIAS], t[Mamba2Field::A],
                                      t[Mamba2Field::D], t[Mamba2Field::SSM_NORM], h, n_group);
    check_matrix(kOp, t[Mamba2Field::IN_PROJ], q[Mamba2Matrix::IN_PROJ], width, dm, "in_proj");
    check_matrix(kOp, t[Mamba2Field::OUT_PROJ], q[Mamba2Matrix::OUT_PROJ], dm, h.size(1) * h.size(2), "out_proj");
  }
  check_f32(kOp, norm_f, dm, "norm_f");
  TORCH_CHECK_VALUE(head.dim() == 2, "mamba2 step: head must be a matrix, got ", head.sizes());
  check_matrix(kOp, head, head_qtype, head.size(0), dm, "head");

  const float feps = static_cast<float>(eps);
  at::Tensor x = x_in.contiguous().clone();  // the residual stream
  at::Tensor u = at::empty_like(x);
  float *xp = x.data_ptr<float>(), *up = u.data_ptr<float>();
  for (int64_t il = 0; il < n_layer; ++il) {
    const at::Tensor* t = layers.data() + il * kLayerTensors;
    const int64_t* q = qtypes.data() + il * kQtypes;
    rms_norm_rows(xp, t[Mamba2Field::NORM].data_ptr<float>(), up, M, dm, feps);
    const at::Tensor zxbcdt = product(u, t[Mamba2Field::IN_PROJ], q[Mamba2Matrix::IN_PROJ]);
    at::Tensor window = t[Mamba2Field::WINDOW], h = t[Mamba2Field::H];
    const at::Tensor y = mixer(zxbcdt, window, t[Mamba2Field::CONV_WEIGHT], t[Mamba2Field::CONV_BIAS],
                               t[Mamba2Field::DT_BIAS], t[Mamba2Field::A], t[Mamba2Field::D], t[Mamba2Field::SSM_NORM],
                               h, n_group, eps);
    step::add_product(xp, y, t[Mamba2Field::OUT_PROJ], q[Mamba2Matrix::OUT_PROJ]);
  }
  rms_norm_rows(xp, norm_f.data_ptr<float>(), up, M, dm, feps);
  return product(u, head, head_qtype);
}

}  // namespace
}  // namespace rsmem

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def(
      "mamba2_mixer_one_(Tensor zxbcdt, Tensor(a!) window, Tensor conv_weight, Tensor conv_bias, Tensor dt_bias, "
      "Tensor A, Tensor D, Tensor ssm_norm, Tensor(b!) h, int n_group, float eps) -> Tensor",
      &rsmem::mamba2_mixer_one_);
  m.def(
      "mamba2_step(Tensor x, Tensor[] layers, int[] qtypes, Tensor norm_f, Tensor head, int head_qtype, "
      "int n_group, float eps) -> Tensor",
      &rsmem::mamba2_step);
}
