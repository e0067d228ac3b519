// A hybrid model's one-token decode step in C++ (LFM2, Nemotron-H): one op call a token of one or a few
// sequences, attention's KV store and attention included, instead of a compiled chain per stretch between
// attention layers with the KV cache's part eager between them (around the products a token paid a large
// share of its time for dynamo's guards, the chains' wrappers, SDPA's parallel region for one query and
// the KV store's index copy).
//
//   hybrid_step(x [M, d_model], kinds int[], blocks Tensor[], qtypes int[] (2 a block), heads int[]
//       (n_head, n_head_kv an attention block), scales float[] (one an attention block), store [M] long,
//       index [M, W] long, valid [M, W] bool, cos [M, n_rot / 2], sin, norm_f, head, head_qtype, n_group,
//       eps) -> logits [M, n_vocab]
//
// The step is a program of residual blocks, x += f(rms_norm(x)), each of a kind with a fixed list of
// tensors (matrices float32 [out, in] with contiguous rows, qtype -1, or blocks for rsmem_native::qmatmul):
//   kConv (0), LFM2's short convolution: norm, conv_in [3 d, d] (b, c, x), conv [d, L], conv_out [d, d],
//       window [M, d, L-1] (moved in place): y = c * conv(b * x)
//   kSwiglu (1): norm, gate_up [2 f, d] (gate rows first), down [d, f]: silu(g) * u
//   kRelu2 (2), Nemotron-H's MLP: norm, up [f, d], down [d, f]: relu(u)^2
//   kAttention (3): norm, wqkv [(H + 2 Hkv) D, d], q_norm [D] and k_norm [D] (empty: none), wo [d, H D],
//       k_rows and v_rows [cells, Hkv D] (the layer's KV cache as rows): per head RMS norms of q and k,
//       NeoX RoPE over the first 2 n_rot/2 channels of each head (cos empty: none), k and v stored in row
//       store[m], then row m's query heads attend over rows index[m, j] where valid[m, j] (query head h
//       reads KV head h / (H / Hkv)), softmax(scale q k) v
//   kMamba2 (4): Mamba-2's layer as mamba2_step's (mamba2_mixer.h): norm, in_proj, conv_weight, conv_bias,
//       dt_bias, A, D, ssm_norm, out_proj, window [M, ...], h [M, H, P, N]
// then the final norm and the head. Every operand is checked before any state or cache row is written.
//
// Reference twin: the compiled chains' blocks (rsmem.models.step.hybrid_fused) with the KV cache's
// attention (rsmem.memory.kv_attention), tests/kernels/test_hybrid_step.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "mamba2_mixer.h"
#include "pool.h"
#include "step_common.h"

namespace rsmem {
namespace {

using step::check_f32;
using step::check_matrix;
using step::product;
using step::rms_norm_rows;
using step::silu;

constexpr const char* kOp = "hybrid step";

enum Kind : int64_t { kConv = 0, kSwiglu = 1, kRelu2 = 2, kAttention = 3, kMamba2 = 4 };

// Each kind's operands, named as rsmem.models.step.operands' CONV_BLOCK, MLP_BLOCK (SwiGLU's and ReLU²'s),
// ATTENTION_BLOCK and MAMBA2 (step_common.h)
struct ConvField {
  enum : int64_t { NORM, CONV_IN, CONV, CONV_OUT, WINDOW, N_FIELDS };
};
struct ConvMatrix {
  enum : int64_t { CONV_IN, CONV_OUT, N_MATRICES };
};
struct MlpField {
  enum : int64_t { NORM, UP, DOWN, N_FIELDS };
};
struct MlpMatrix {
  enum : int64_t { UP, DOWN, N_MATRICES };
};
struct AttentionField {
  enum : int64_t { NORM, WQKV, Q_NORM, K_NORM, WO, K_ROWS, V_ROWS, N_FIELDS };
};
struct AttentionMatrix {
  enum : int64_t { WQKV, WO, N_MATRICES };
};
using step::Mamba2Field;
using step::Mamba2Matrix;

constexpr int64_t kTensors[] = {ConvField::N_FIELDS, MlpField::N_FIELDS, MlpField::N_FIELDS, AttentionField::N_FIELDS,
                                Mamba2Field::N_FIELDS};
constexpr int64_t kQtypes = 2;  // a block's matrices
static_assert(ConvMatrix::N_MATRICES == kQtypes && MlpMatrix::N_MATRICES == kQtypes &&
                  AttentionMatrix::N_MATRICES == kQtypes && Mamba2Matrix::N_MATRICES == kQtypes,
              "every block kind has two matrices");
// every block's pre-norm, read before its kind is looked at
constexpr int64_t kNorm = 0;
static_assert(ConvField::NORM == kNorm && MlpField::NORM == kNorm && AttentionField::NORM == kNorm &&
                  Mamba2Field::NORM == kNorm,
              "every block's norm comes first");

// The attention blocks' shared operands: each row's KV row to write, its visible rows, and RoPE's tables.
struct Cells {
  const int64_t* store;
  const int64_t* index;
  const bool* valid;
  int64_t width;
  const float* cos;  // null: no RoPE
  const float* sin;
  int64_t half;
};

int64_t check_kind(int64_t kind) {
  TORCH_CHECK_VALUE(kind >= kConv && kind <= kMamba2, kOp, ": unknown block kind ", kind);
  return kTensors[kind];
}

// A block's operands; n_rows is the KV caches' rows (every attention block's caches have them).
void check_block(int64_t kind, const at::Tensor* t, const int64_t* q, int64_t M, int64_t dm, int64_t H,
                 int64_t Hkv, int64_t half, int64_t n_group) {
  check_f32(kOp, t[kNorm], dm, "norm");
  if (kind == kConv) {
    const at::Tensor& conv = t[ConvField::CONV];
    TORCH_CHECK_VALUE(conv.dim() == 2 && conv.size(0) == dm && conv.size(1) >= 2, kOp, ": conv must be [", dm,
                      ", L], got ", conv.sizes());
    const int64_t L = conv.size(1);
    check_f32(kOp, conv, dm * L, "conv");
    check_f32(kOp, t[ConvField::WINDOW], M * dm * (L - 1), "window");
    check_matrix(kOp, t[ConvField::CONV_IN], q[ConvMatrix::CONV_IN], 3 * dm, dm, "conv_in");
    check_matrix(kOp, t[ConvField::CONV_OUT], q[ConvMatrix::CONV_OUT], dm, dm, "conv_out");
  } else if (kind == kSwiglu || kind == kRelu2) {
    const at::Tensor& down = t[MlpField::DOWN];
    TORCH_CHECK_VALUE(down.dim() == 2 && down.size(0) == dm, kOp, ": down must be [", dm, ", f], got ",
                      down.sizes());
    const int64_t f = down.size(1);
    check_matrix(kOp, t[MlpField::UP], q[MlpMatrix::UP], kind == kSwiglu ? 2 * f : f, dm,
                 kind == kSwiglu ? "gate_up" : "up");
    check_matrix(kOp, down, q[MlpMatrix::DOWN], dm, f, "down");
  } else if (kind == kAttention) {
    const at::Tensor& wqkv = t[AttentionField::WQKV];
    TORCH_CHECK_VALUE(H > 0 && Hkv > 0 && H % Hkv == 0, kOp, ": ", H, " query heads over ", Hkv, " KV heads");
    TORCH_CHECK_VALUE(wqkv.dim() == 2 && wqkv.size(0) % (H + 2 * Hkv) == 0, kOp, ": wqkv ", wqkv.sizes(),
                      " does not fit ", H, " + 2 x ", Hkv, " heads");
    const int64_t D = wqkv.size(0) / (H + 2 * Hkv);
    TORCH_CHECK_VALUE(2 * half <= D, kOp, ": RoPE over ", 2 * half, " channels of heads of ", D);
    check_matrix(kOp, wqkv, q[AttentionMatrix::WQKV], (H + 2 * Hkv) * D, dm, "wqkv");
    for (int64_t i : {AttentionField::Q_NORM, AttentionField::K_NORM}) {
      if (t[i].numel() != 0) check_f32(kOp, t[i], D, i == AttentionField::Q_NORM ? "q_norm" : "k_norm");
    }
    check_matrix(kOp, t[AttentionField::WO], q[AttentionMatrix::WO], dm, H * D, "wo");
    for (int64_t i : {AttentionField::K_ROWS, AttentionField::V_ROWS}) {
      TORCH_CHECK_VALUE(t[i].scalar_type() == at::kFloat && t[i].dim() == 2 && t[i].size(1) == Hkv * D &&
                            t[i].is_contiguous(),
                        kOp, ": ", i == AttentionField::K_ROWS ? "k_rows" : "v_rows",
                        " must be contiguous float32 [cells, ", Hkv * D, "], got ", t[i].scalar_type(), " ",
                        t[i].sizes());
    }
    TORCH_CHECK_VALUE(t[AttentionField::K_ROWS].size(0) == t[AttentionField::V_ROWS].size(0), kOp,
                      ": k_rows and v_rows differ in cells");
  } else {
    const at::Tensor& h = t[Mamba2Field::H];
    TORCH_CHECK_VALUE(h.dim() == 4 && h.size(0) == M, kOp, ": h must be [", M, ", H, P, N], got ", h.sizes());
    const int64_t width = step::check_mixer(kOp, t[Mamba2Field::WINDOW], t[Mamba2Field::CONV_WEIGHT],
                                            t[Mamba2Field::CONV_BIAS], t[Mamba2Field::DT_BIAS], t[Mamba2Field::A],
                                            t[Mamba2Field::D], t[Mamba2Field::SSM_NORM], h, n_group);
    check_matrix(kOp, t[Mamba2Field::IN_PROJ], q[Mamba2Matrix::IN_PROJ], width, dm, "in_proj");
    check_matrix(kOp, t[Mamba2Field::OUT_PROJ], q[Mamba2Matrix::OUT_PROJ], dm, h.size(1) * h.size(2), "out_proj");
  }
}

// NeoX rotation of the first 2 half channels of a head of D values
inline void rope_head(float* v, const float* cos, const float* sin, int64_t half) {
  for (int64_t i = 0; i < half; ++i) {
    const float a = v[i], b = v[i + half];
    v[i] = a * cos[i] - b * sin[i];
    v[i + half] = a * sin[i] + b * cos[i];
  }
}

// RMS norm of one head's D values in place, times w
inline void norm_head(float* v, const float* w, int64_t D, float eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < D; ++i) ss += v[i] * v[i];
  const float scale = 1.f / std::sqrt(ss / static_cast<float>(D) + eps);
  for (int64_t i = 0; i < D; ++i) v[i] = v[i] * scale * w[i];
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

// out [M, H D]: each row's query heads over its visible KV rows (query head h reads KV head h / rep)
void attend(const float* qkv, int64_t ld, const float* krows, const float* vrows, const Cells& cells, int64_t M,
            int64_t H, int64_t Hkv, int64_t D, float scale, float* out) {
  const int64_t rep = H / Hkv, W = cells.width, width = Hkv * D;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / std::max<int64_t>(1, 2 * W * D));
  pool::parallel_for(0, M * Hkv, grain, [&](int64_t i0, int64_t i1) {
    std::vector<float> scores(static_cast<size_t>(rep * W));
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t m = i / Hkv, g = i % Hkv;
      const int64_t* idx = cells.index + m * W;
      const bool* ok = cells.valid + m * W;
      const float* q0 = qkv + m * ld + g * rep * D;
      float* o0 = out + m * H * D + g * rep * D;
      for (int64_t r = 0; r < rep; ++r) {
        float* s = scores.data() + r * W;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < W; ++j) {
          s[j] = ok[j] ? scale * dot(q0 + r * D, krows + idx[j] * width + g * D, D)
                       : -std::numeric_limits<float>::infinity();
          top = std::max(top, s[j]);
        }
        float sum = 0.f;
        for (int64_t j = 0; j < W; ++j) {
          s[j] = ok[j] ? std::exp(s[j] - top) : 0.f;
          sum += s[j];
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        for (int64_t j = 0; j < W; ++j) s[j] *= inv;
        std::fill(o0 + r * D, o0 + (r + 1) * D, 0.f);
      }
      for (int64_t j = 0; j < W; ++j) {
        if (!ok[j]) continue;
        const float* v = vrows + idx[j] * width + g * D;
        for (int64_t r = 0; r < rep; ++r) {
          const float p = scores[r * W + j];
          float* o = o0 + r * D;
#pragma omp simd
          for (int64_t c = 0; c < D; ++c) o[c] += p * v[c];
        }
      }
    }
  });
}

void attention_block(float* x, const at::Tensor& u, const at::Tensor* t, const int64_t* q, int64_t M, int64_t H,
                     int64_t Hkv, float scale, const Cells& cells, float eps) {
  const at::Tensor qkv = product(u, t[AttentionField::WQKV], q[AttentionMatrix::WQKV]);  // [M, (H + 2 Hkv) D]
  const int64_t ld = qkv.size(1), D = ld / (H + 2 * Hkv), width = Hkv * D;
  float* qp = qkv.data_ptr<float>();
  float *krows = t[AttentionField::K_ROWS].data_ptr<float>(), *vrows = t[AttentionField::V_ROWS].data_ptr<float>();
  const at::Tensor &q_norm = t[AttentionField::Q_NORM], &k_norm = t[AttentionField::K_NORM];
  const float* qn = q_norm.numel() ? q_norm.data_ptr<float>() : nullptr;
  const float* kn = k_norm.numel() ? k_norm.data_ptr<float>() : nullptr;
  for (int64_t m = 0; m < M; ++m) {
    float* row = qp + m * ld;
    for (int64_t h = 0; h < H + Hkv; ++h) {  // query heads, then key heads
      float* v = row + h * D;
      const float* w = h < H ? qn : kn;
      if (w != nullptr) norm_head(v, w, D, eps);
      if (cells.cos != nullptr) rope_head(v, cells.cos + m * cells.half, cells.sin + m * cells.half, cells.half);
    }
    std::copy(row + H * D, row + H * D + width, krows + cells.store[m] * width);
    std::copy(row + H * D + width, row + H * D + 2 * width, vrows + cells.store[m] * width);
  }
  at::Tensor o = at::empty({M, H * D}, qkv.options());
  attend(qp, ld, krows, vrows, cells, M, H, Hkv, D, scale, o.data_ptr<float>());
  step::add_product(x, o, t[AttentionField::WO], q[AttentionMatrix::WO]);
}

void conv_block(float* x, const at::Tensor& uu, const at::Tensor* t, const int64_t* q, int64_t M, int64_t dm) {
  const at::Tensor bcx = product(uu, t[ConvField::CONV_IN], q[ConvMatrix::CONV_IN]);  // [M, 3 d]: b, c, x
  const int64_t L = t[ConvField::CONV].size(1);
  const float* w = t[ConvField::CONV].data_ptr<float>();
  float* win = t[ConvField::WINDOW].data_ptr<float>();
  at::Tensor y = at::empty({M, dm}, bcx.options());
  const float* bp = bcx.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float *b = bp + m * 3 * dm, *c = b + dm, *xx = b + 2 * dm;
    for (int64_t ch = 0; ch < dm; ++ch) {
      float* wc = win + (m * dm + ch) * (L - 1);
      const float* kc = w + ch * L;
      const float bx = b[ch] * xx[ch];
      float acc = kc[L - 1] * bx;
      for (int64_t k = 0; k < L - 1; ++k) acc += kc[k] * wc[k];
      for (int64_t k = 0; k + 2 < L; ++k) wc[k] = wc[k + 1];
      wc[L - 2] = bx;
      yp[m * dm + ch] = c[ch] * acc;
    }
  }
  step::add_product(x, y, t[ConvField::CONV_OUT], q[ConvMatrix::CONV_OUT]);
}

void mlp_block(float* x, const at::Tensor& uu, const at::Tensor* t, const int64_t* q, bool swiglu) {
  const at::Tensor up = product(uu, t[MlpField::UP], q[MlpMatrix::UP]);
  const int64_t M = up.size(0), f = swiglu ? up.size(1) / 2 : up.size(1);
  at::Tensor a = swiglu ? at::empty({M, f}, up.options()) : up;
  const float* src = up.data_ptr<float>();
  float* dst = a.data_ptr<float>();
  for (int64_t m = 0; m < M; ++m) {
    const float* row = src + m * up.size(1);
    float* out = dst + m * f;
    if (swiglu) {
      for (int64_t j = 0; j < f; ++j) out[j] = silu(row[j]) * row[f + j];
    } else {
      for (int64_t j = 0; j < f; ++j) out[j] = row[j] > 0.f ? row[j] * row[j] : 0.f;
    }
  }
  step::add_product(x, a, t[MlpField::DOWN], q[MlpMatrix::DOWN]);
}

at::Tensor hybrid_step(const at::Tensor& x_in, at::IntArrayRef kinds, at::TensorList blocks, at::IntArrayRef qtypes,
                       at::IntArrayRef heads, at::ArrayRef<double> scales, const at::Tensor& store,
                       const at::Tensor& index, const at::Tensor& valid, const at::Tensor& cos, const at::Tensor& sin,
                       const at::Tensor& norm_f, const at::Tensor& head, int64_t head_qtype, int64_t n_group,
                       double eps) {
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(0) >= 1,
                    kOp, ": x must be float32 [M, d_model], got ", x_in.sizes());
  const int64_t M = x_in.size(0), dm = x_in.size(1);
  TORCH_CHECK_VALUE(qtypes.size() == kQtypes * kinds.size(), kOp, ": ", kQtypes, " qtypes a block, got ",
                    qtypes.size(), " for ", kinds.size(), " blocks");
  int64_t n_tensors = 0, n_attention = 0;
  for (const int64_t kind : kinds) {
    n_tensors += check_kind(kind);
    n_attention += kind == kAttention;
  }
  TORCH_CHECK_VALUE(static_cast<int64_t>(blocks.size()) == n_tensors, kOp, ": the blocks take ", n_tensors,
                    " tensors, got ", blocks.size());
  TORCH_CHECK_VALUE(static_cast<int64_t>(heads.size()) == 2 * n_attention &&
                        static_cast<int64_t>(scales.size()) == n_attention,
                    kOp, ": 2 head counts and a scale an attention block, got ", heads.size(), " and ",
                    scales.size(), " for ", n_attention);
  Cells cells{nullptr, nullptr, nullptr, 0, nullptr, nullptr, 0};
  if (n_attention > 0) {
    TORCH_CHECK_VALUE(store.scalar_type() == at::kLong && store.is_contiguous() && store.numel() == M, kOp,
                      ": store must be ", M, " int64 rows, got ", store.scalar_type(), " ", store.sizes());
    TORCH_CHECK_VALUE(index.scalar_type() == at::kLong && index.is_contiguous() && index.dim() == 2 &&
                          index.size(0) == M,
                      kOp, ": index must be int64 [", M, ", W], got ", index.scalar_type(), " ", index.sizes());
    TORCH_CHECK_VALUE(valid.scalar_type() == at::kBool && valid.is_contiguous() && valid.sizes() == index.sizes(),
                      kOp, ": valid must be bool ", index.sizes(), ", got ", valid.scalar_type(), " ",
                      valid.sizes());
    cells = {store.data_ptr<int64_t>(), index.data_ptr<int64_t>(), valid.data_ptr<bool>(), index.size(1),
             nullptr, nullptr, 0};
    if (cos.numel() != 0) {
      TORCH_CHECK_VALUE(cos.dim() == 2 && cos.size(0) == M, kOp, ": cos must be [", M, ", n_rot / 2], got ",
                        cos.sizes());
      cells.half = cos.size(1);
      check_f32(kOp, cos, M * cells.half, "cos");
      check_f32(kOp, sin, M * cells.half, "sin");
      cells.cos = cos.data_ptr<float>();
      cells.sin = sin.data_ptr<float>();
    }
  }
  // every block's operands first, then the KV rows the step reads and writes: a bad one is an error before
  // any state is written
  {
    int64_t at_t = 0, at_a = 0;
    for (size_t b = 0; b < kinds.size(); ++b) {
      const at::Tensor* t = blocks.data() + at_t;
      const int64_t H = kinds[b] == kAttention ? heads[2 * at_a] : 0;
      const int64_t Hkv = kinds[b] == kAttention ? heads[2 * at_a + 1] : 0;
      check_block(kinds[b], t, qtypes.data() + kQtypes * b, M, dm, H, Hkv, cells.half, n_group);
      if (kinds[b] == kAttention) {
        const int64_t n_rows = t[AttentionField::K_ROWS].size(0);
        const int64_t* idx = cells.index;
        for (int64_t i = 0; i < M * cells.width; ++i) {
          TORCH_CHECK_VALUE(!cells.valid[i] || (idx[i] >= 0 && idx[i] < n_rows), kOp, ": index ", idx[i],
                            " is outside the ", n_rows, " KV rows");
        }
        for (int64_t m = 0; m < M; ++m) {
          TORCH_CHECK_VALUE(cells.store[m] >= 0 && cells.store[m] < n_rows, kOp, ": store row ", cells.store[m],
                            " is outside the ", n_rows, " KV rows");
        }
        ++at_a;
      }
      at_t += kTensors[kinds[b]];
    }
  }
  check_f32(kOp, norm_f, dm, "norm_f");
  TORCH_CHECK_VALUE(head.dim() == 2, kOp, ": head must be a matrix, got ", head.sizes());
  check_matrix(kOp, head, head_qtype, head.size(0), dm, "head");

  const float feps = static_cast<float>(eps);
  at::Tensor x = x_in.contiguous().clone();  // the residual stream
  at::Tensor u = at::empty_like(x);
  float *xp = x.data_ptr<float>(), *up = u.data_ptr<float>();
  int64_t at_t = 0, at_a = 0;
  for (size_t b = 0; b < kinds.size(); ++b) {
    const at::Tensor* t = blocks.data() + at_t;
    const int64_t* q = qtypes.data() + kQtypes * b;
    rms_norm_rows(xp, t[kNorm].data_ptr<float>(), up, M, dm, feps);
    switch (kinds[b]) {
      case kConv:
        conv_block(xp, u, t, q, M, dm);
        break;
      case kSwiglu:
      case kRelu2:
        mlp_block(xp, u, t, q, kinds[b] == kSwiglu);
        break;
      case kAttention:
        attention_block(xp, u, t, q, M, heads[2 * at_a], heads[2 * at_a + 1],
                        static_cast<float>(scales[at_a]), cells, feps);
        ++at_a;
        break;
      default: {
        const at::Tensor zxbcdt = product(u, t[Mamba2Field::IN_PROJ], q[Mamba2Matrix::IN_PROJ]);
        at::Tensor window = t[Mamba2Field::WINDOW], h = t[Mamba2Field::H];
        const at::Tensor y = step::mixer(zxbcdt, window, t[Mamba2Field::CONV_WEIGHT], t[Mamba2Field::CONV_BIAS],
                                         t[Mamba2Field::DT_BIAS], t[Mamba2Field::A], t[Mamba2Field::D],
                                         t[Mamba2Field::SSM_NORM], h, n_group, eps);
        step::add_product(xp, y, t[Mamba2Field::OUT_PROJ], q[Mamba2Matrix::OUT_PROJ]);
      }
    }
    at_t += kTensors[kinds[b]];
  }
  rms_norm_rows(xp, norm_f.data_ptr<float>(), up, M, dm, feps);
  return product(u, head, head_qtype);
}

}  // namespace
}  // namespace rsmem

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def(
      "hybrid_step(Tensor x, int[] kinds, Tensor[] blocks, int[] qtypes, int[] heads, float[] scales, "
      "Tensor store, Tensor index, Tensor valid, Tensor cos, Tensor sin, Tensor norm_f, Tensor head, "
      "int head_qtype, int n_group, float eps) -> Tensor",
      &rsmem::hybrid_step);
}
