// Mamba's one-token decode step in C++, as mamba2_step.cpp is Mamba-2's: one op call a token (of one or a
// few sequences) instead of a compiled graph whose Python wrapper and dynamo guards cost milliseconds a
// token around products that already stream the weights at the machine's read rate.
//
//   mamba_step(x [M, d_model], layers: 12 tensors a layer (MambaField: norm, in_proj, conv_weight [D, K],
//       conv_bias, x_proj, dt_proj [D, R] float32, dt_bias, A [D, N], D [D], out_proj, window [M, D, K-1],
//       h [M, D, N]), qtypes [3 a layer (MambaMatrix): in_proj, x_proj, out_proj], norm_f, head, head_qtype,
//       eps) -> logits [M, n_vocab]
//     per layer: the pre-norm, in_proj (x, z), the short convolution and SiLU of x, x_proj (dt, B, C),
//     dt = softplus(dt_proj dt + dt_bias), per channel h = h exp(dt A) + (dt x) B and y = h . C + D x (the
//     state after the token), y * silu(z), out_proj and the residual; then the final norm and the head.
//     Matrices: float32 [out, in] with contiguous rows (qtype -1) or blocks for rsmem_native::qmatmul.
//     Channels (of every sequence) are shared between rsmem's product workers (pool.h). Row m of x, window
//     and h is sequence m.
//
// Reference twin: rsmem.models.step.fused.token_step of mamba_layer_one_, the compiled step's own function
// (tests/kernels/test_mamba_step.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "pool.h"
#include "step_common.h"
#include "vec_math.h"

namespace rsmem {
namespace {

using step::check_f32;
using step::check_matrix;
using step::product;
using step::rms_norm_rows;
using step::silu;
using step::softplus;

constexpr const char* kOp = "mamba step";

// A layer's operands, named as rsmem.models.step.operands.MAMBA's (step_common.h)
struct MambaField {
  enum : int64_t {
    NORM, IN_PROJ, CONV_WEIGHT, CONV_BIAS, X_PROJ, DT_PROJ, DT_BIAS, A, D, OUT_PROJ, WINDOW, H, N_FIELDS
  };
};
struct MambaMatrix {
  enum : int64_t { IN_PROJ, X_PROJ, OUT_PROJ, N_MATRICES };
};
constexpr int64_t kLayerTensors = MambaField::N_FIELDS;
constexpr int64_t kQtypes = MambaMatrix::N_MATRICES;

// One channel's state row [N]: h = h exp(dt A) + dtx B; returns h . C (the row after the update).
inline float update_channel(float* __restrict h, const float* __restrict A, const float* __restrict B,
                            const float* __restrict C, int64_t N, float dt, float dtx) {
  int64_t n = 0;
  float acc = 0.f;
#if defined(__AVX512F__)
  const __m512 vdt = _mm512_set1_ps(dt), vx = _mm512_set1_ps(dtx);
  __m512 a = _mm512_setzero_ps();
  for (; n + 16 <= N; n += 16) {
    const __m512 dA = exp16(_mm512_mul_ps(vdt, _mm512_loadu_ps(A + n)));
    const __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(h + n), dA, _mm512_mul_ps(vx, _mm512_loadu_ps(B + n)));
    _mm512_storeu_ps(h + n, v);
    a = _mm512_fmadd_ps(v, _mm512_loadu_ps(C + n), a);
  }
  acc = _mm512_reduce_add_ps(a);
#endif
  for (; n < N; ++n) {
    const float v = h[n] * std::exp(dt * A[n]) + dtx * B[n];
    h[n] = v;
    acc += v * C[n];
  }
  return acc;
}

// Every layer's operands before anything is written: a bad one is an error with every state as it was.
void check_layers(at::TensorList layers, at::IntArrayRef qtypes, int64_t M, int64_t dm, int64_t dt_rank,
                  int64_t d_state) {
  const int64_t n_layer = static_cast<int64_t>(layers.size()) / kLayerTensors;
  for (int64_t il = 0; il < n_layer; ++il) {
    const at::Tensor* t = layers.data() + il * kLayerTensors;
    const int64_t* q = qtypes.data() + il * kQtypes;
    const at::Tensor& conv_weight = t[MambaField::CONV_WEIGHT];
    TORCH_CHECK_VALUE(conv_weight.dim() == 2 && conv_weight.size(1) >= 2, kOp, ": conv_weight must be [D, K], got ",
                      conv_weight.sizes());
    const int64_t D = conv_weight.size(0), K = conv_weight.size(1), N = d_state, R = dt_rank;
    check_f32(kOp, t[MambaField::NORM], dm, "norm");
    check_matrix(kOp, t[MambaField::IN_PROJ], q[MambaMatrix::IN_PROJ], 2 * D, dm, "in_proj");
    check_f32(kOp, conv_weight, D * K, "conv_weight");
    check_f32(kOp, t[MambaField::CONV_BIAS], D, "conv_bias");
    check_matrix(kOp, t[MambaField::X_PROJ], q[MambaMatrix::X_PROJ], R + 2 * N, D, "x_proj");
    check_matrix(kOp, t[MambaField::DT_PROJ], -1, D, R, "dt_proj");
    check_f32(kOp, t[MambaField::DT_BIAS], D, "dt_bias");
    check_f32(kOp, t[MambaField::A], D * N, "A");
    check_f32(kOp, t[MambaField::D], D, "D");
    check_matrix(kOp, t[MambaField::OUT_PROJ], q[MambaMatrix::OUT_PROJ], dm, D, "out_proj");
    check_f32(kOp, t[MambaField::WINDOW], M * D * (K - 1), "window");
    check_f32(kOp, t[MambaField::H], M * D * N, "h");
  }
}

at::Tensor mamba_step(const at::Tensor& x_in, at::TensorList layers, at::IntArrayRef qtypes,
                      const at::Tensor& norm_f, const at::Tensor& head, int64_t head_qtype, double eps,
                      int64_t dt_rank, int64_t d_state) {
  TORCH_CHECK_VALUE(layers.size() % kLayerTensors == 0 && qtypes.size() * kLayerTensors == kQtypes * layers.size(),
                    kOp, ": ", kLayerTensors, " tensors and ", kQtypes, " qtypes a layer, got ", layers.size(), " and ",
                    qtypes.size());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(0) >= 1, kOp,
                    ": x must be float32 [M, d_model], got ", x_in.sizes());
  TORCH_CHECK_VALUE(dt_rank > 0 && d_state > 0, kOp, ": dt_rank and d_state must be positive");
  const int64_t M = x_in.size(0), dm = x_in.size(1), R = dt_rank, N = d_state;
  check_layers(layers, qtypes, M, dm, R, N);
  check_f32(kOp, norm_f, dm, "norm_f");
  TORCH_CHECK_VALUE(head.dim() == 2, kOp, ": head must be a matrix, got ", head.sizes());
  check_matrix(kOp, head, head_qtype, head.size(0), dm, "head");

  const float feps = static_cast<float>(eps);
  at::Tensor x = x_in.contiguous().clone();  // the residual stream
  at::Tensor u = at::empty_like(x);
  float *xp = x.data_ptr<float>(), *up = u.data_ptr<float>();
  const int64_t n_layer = static_cast<int64_t>(layers.size()) / kLayerTensors;
  for (int64_t il = 0; il < n_layer; ++il) {
    const at::Tensor* t = layers.data() + il * kLayerTensors;
    const int64_t* q = qtypes.data() + il * kQtypes;
    const int64_t D = t[MambaField::CONV_WEIGHT].size(0), K = t[MambaField::CONV_WEIGHT].size(1);
    rms_norm_rows(xp, t[MambaField::NORM].data_ptr<float>(), up, M, dm, feps);
    const at::Tensor xz = product(u, t[MambaField::IN_PROJ], q[MambaMatrix::IN_PROJ]);  // [M, 2D]: x, then z
    const float* xzp = xz.data_ptr<float>();
    at::Tensor xc = at::empty({M, D}, x.options());
    float *xcp = xc.data_ptr<float>(), *win = t[MambaField::WINDOW].data_ptr<float>();
    const float *cw = t[MambaField::CONV_WEIGHT].data_ptr<float>(), *cb = t[MambaField::CONV_BIAS].data_ptr<float>();
    for (int64_t m = 0; m < M; ++m)
      step::conv_silu_token(xzp + m * 2 * D, win + m * D * (K - 1), cw, cb, xcp + m * D, D, K);
    const at::Tensor dbc = product(xc, t[MambaField::X_PROJ], q[MambaMatrix::X_PROJ]);  // [M, R + 2N]: dt, B, C
    const at::Tensor dt = product(dbc.narrow(1, 0, R).contiguous(), t[MambaField::DT_PROJ], -1);
    const float *dtp = dt.data_ptr<float>(), *dbcp = dbc.data_ptr<float>();
    const float* dtb = t[MambaField::DT_BIAS].data_ptr<float>();
    const float *Ap = t[MambaField::A].data_ptr<float>(), *Dp = t[MambaField::D].data_ptr<float>();
    float* hp = t[MambaField::H].data_ptr<float>();
    at::Tensor y = at::empty({M, D}, x.options());
    float* yp = y.data_ptr<float>();
    const int64_t ld = R + 2 * N;
    pool::parallel_for(0, M * D, std::max<int64_t>(64, (int64_t{1} << 13) / N), [&](int64_t i0, int64_t i1) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t m = i / D, d = i % D;
        const float* Bp = dbcp + m * ld + R;
        const float dtd = softplus(dtp[i] + dtb[d]);
        const float hc = update_channel(hp + i * N, Ap + d * N, Bp, Bp + N, N, dtd, dtd * xcp[i]);
        yp[i] = (hc + Dp[d] * xcp[i]) * silu(xzp[m * 2 * D + D + d]);
      }
    });
    step::add_product(xp, y, t[MambaField::OUT_PROJ], q[MambaMatrix::OUT_PROJ]);
  }
  rms_norm_rows(xp, norm_f.data_ptr<float>(), up, M, dm, feps);
  return product(u, head, head_qtype);
}

}  // namespace
}  // namespace rsmem

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def(
      "mamba_step(Tensor x, Tensor[] layers, int[] qtypes, Tensor norm_f, Tensor head, int head_qtype, "
      "float eps, int dt_rank, int d_state) -> Tensor",
      &rsmem::mamba_step);
}
