// RWKV-7's one-token decode step in C++: one op call a token of one or a few sequences, instead of a compiled
// graph whose dynamo guards (~30 inputs a layer) and Python wrapper cost more than its glue computes.
//
//   rwkv7_step(x [M, C], layers: 30 tensors a layer, qtypes [6 a layer: receptance, key, value, output,
//       ffn_key, ffn_value], norm_f, head, head_qtype, eps, n_head, emb_norm, emb_norm_b, norm_f_b,
//       slices, n_slices) -> logits [M, n_vocab]
//
// A layer's tensors (Rwkv7Field) are rsmem.models.step.operands.RWKV7_FIELDS, then its token-shift rows
// [M, 2, C] and WKV state [M, H, N(v), N(k)], both updated in place:
//   attn_norm, attn_norm_b, ffn_norm, ffn_norm_b, lerp [6, C] (r, w, k, v, a, g), w0, w1 [Lw, C], w2 [C, Lw],
//   a0, a1, a2, v0, v1, v2, g1, g2, k_k, k_a, r_k, receptance, key, value, output, ln_x, ln_x_b,
//   ffn_lerp_k, ffn_key [F, C], ffn_value [C, F]
// The six big matrices are float32 [out, in] with contiguous rows (qtype -1), its oneDNN packed twin (-2),
// the plain matrix with its packed slices in `slices` (-3: n_slices a matrix, the head's last; step_common.h)
// or blocks for rsmem_native::qmatmul; the low-rank ones float32 [out, in]. The first layer's values are every later
// layer's value-residual target (its v0, v1, v2 are not read). Per layer, as llama.cpp's rwkv7 graph:
//   h = layer_norm(x); six lerps of h with the shifted row; r, k, v; the decay w = exp(-e^-0.5 sigmoid(w0 +
//   tanh(xw w1^T) w2^T)); v += (v_first - v) sigmoid(v0 + xv v1^T v2^T) (not in the first layer);
//   a = sigmoid(a0 + xa a1^T a2^T); g = sigmoid(xg g1^T) g2^T; kk = L2-normalised k k_k per head;
//   k *= 1 + (a - 1) k_a; per head S = S diag(w) + (S (-kk)) (kk a)^T + v k^T, y = S r; group norm (eps
//   64e-5) of each head; y += (r . k r_k) v per head; x += (y g) output^T; then the channel mix
//   f = layer_norm(x), x += relu((f + (shift - f) lerp_k) ffn_key^T)^2 ffn_value^T.
// The WKV update of every sequence's heads is shared between rsmem's product workers (pool.h).
//
// Reference twin: rsmem.models.step.wkv_fused.rwkv7_token_one_, the compiled step's own function
// (tests/kernels/test_rwkv_step.py).
#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>

#include "pool.h"
#include "step_common.h"
#include "wkv_token.h"

namespace rsmem {
namespace {

using step::check_f32;
using step::check_matrix;
using step::lora;
using step::layer_norm_rows;
using step::product;
using step::sigmoid;

constexpr const char* kOp = "rwkv7 step";

// A layer's operands, named as rsmem.models.step.operands.RWKV7's (step_common.h)
struct Rwkv7Field {
  enum : int64_t {
    ATTN_NORM, ATTN_NORM_B, FFN_NORM, FFN_NORM_B, LERP, W0, W1, W2, A0, A1, A2, V0, V1, V2, G1, G2, K_K, K_A, R_K,
    RECEPTANCE, KEY, VALUE, OUTPUT, LN_X, LN_X_B, FFN_LERP_K, FFN_KEY, FFN_VALUE, SHIFT, WKV, N_FIELDS
  };
};
struct Rwkv7Matrix {
  enum : int64_t { RECEPTANCE, KEY, VALUE, OUTPUT, FFN_KEY, FFN_VALUE, N_MATRICES };
};
constexpr int64_t kLayerTensors = Rwkv7Field::N_FIELDS;
constexpr int64_t kQtypes = Rwkv7Matrix::N_MATRICES;
constexpr float kGroupNormEps = 64e-5f;
constexpr float kDecayScale = 0.606531f;

void check_layer(const at::Tensor* t, const int64_t* q, bool first, int64_t M, int64_t C, int64_t H,
                 const step::Slices& sl, int64_t j) {
  const int64_t N = C / H;
  for (int64_t i : {Rwkv7Field::ATTN_NORM, Rwkv7Field::ATTN_NORM_B, Rwkv7Field::FFN_NORM, Rwkv7Field::FFN_NORM_B,
                    Rwkv7Field::W0, Rwkv7Field::A0, Rwkv7Field::K_K, Rwkv7Field::K_A, Rwkv7Field::R_K, Rwkv7Field::LN_X,
                    Rwkv7Field::LN_X_B, Rwkv7Field::FFN_LERP_K}) {
    check_f32(kOp, t[i], C, "a layer's vector");
  }
  check_f32(kOp, t[Rwkv7Field::LERP], 6 * C, "lerp");
  // each low-rank pair: its name, its first factor and its second
  struct LowRank {
    const char* name;
    int64_t down, up;
  };
  for (const LowRank& l :
       {LowRank{"w", Rwkv7Field::W1, Rwkv7Field::W2}, LowRank{"a", Rwkv7Field::A1, Rwkv7Field::A2},
        LowRank{"v", Rwkv7Field::V1, Rwkv7Field::V2}, LowRank{"g", Rwkv7Field::G1, Rwkv7Field::G2}}) {
    if (l.down == Rwkv7Field::V1 && first) continue;  // the first layer's value-residual mix is not read
    const at::Tensor& down = t[l.down];
    step::check_lora(kOp, down, -1, C, l.name);
    step::check_lora(kOp, t[l.up], C, down.size(0), l.name);
  }
  if (!first) check_f32(kOp, t[Rwkv7Field::V0], C, "v0");
  auto matrix = [&](int64_t field, int64_t m, int64_t rows, int64_t cols, const char* name) {
    check_matrix(kOp, t[field], q[m], rows, cols, name, sl.of(j + m));
  };
  matrix(Rwkv7Field::RECEPTANCE, Rwkv7Matrix::RECEPTANCE, C, C, "receptance");
  matrix(Rwkv7Field::KEY, Rwkv7Matrix::KEY, C, C, "key");
  matrix(Rwkv7Field::VALUE, Rwkv7Matrix::VALUE, C, C, "value");
  matrix(Rwkv7Field::OUTPUT, Rwkv7Matrix::OUTPUT, C, C, "output");
  const at::Tensor& ffn_value = t[Rwkv7Field::FFN_VALUE];
  TORCH_CHECK_VALUE(ffn_value.dim() == 2 && ffn_value.size(0) == C, kOp, ": ffn_value must be [", C, ", F], got ",
                    ffn_value.sizes());
  const int64_t F = ffn_value.size(1);
  matrix(Rwkv7Field::FFN_KEY, Rwkv7Matrix::FFN_KEY, F, C, "ffn_key");
  matrix(Rwkv7Field::FFN_VALUE, Rwkv7Matrix::FFN_VALUE, C, F, "ffn_value");
  check_f32(kOp, t[Rwkv7Field::SHIFT], M * 2 * C, "shift");
  check_f32(kOp, t[Rwkv7Field::WKV], M * H * N * N, "wkv");
}

// the WKV update and readout of every (sequence, head): S [N(v), N(k)]
void wkv7(float* S, const float* r, const float* w, const float* k, const float* v, const float* kk,
          const float* a, float* y, int64_t M, int64_t H, int64_t N) {
  const int64_t C = H * N;
  pool::parallel_for(0, M * H, std::max<int64_t>(1, 4096 / (N * N)), [&](int64_t i0, int64_t i1) {
    float nkk[256], b[256];
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t off = (i / H) * C + (i % H) * N;
      for (int64_t j = 0; j < N; ++j) {
        nkk[j] = -kk[off + j];
        b[j] = kk[off + j] * a[off + j];
      }
      wkv::token7(S + i * N * N, r + off, w + off, k + off, v + off, nkk, b, y + off, N);
    }
  });
}

// A layer's products of its six mixed inputs: r, k, v and the low-rank terms dw (tanh between the factors),
// da, dv (none in the first layer) and g (sigmoid between them)
struct MixProducts {
  at::Tensor r, k, v, dw, da, dv, g;
};

MixProducts mix_products(const at::Tensor* t, const int64_t* q, const at::Tensor& mix, bool first,
                         const step::Slices& sl, int64_t j) {
  const int64_t M = mix.size(1), C = mix.size(2);
  const at::Tensor &wr = t[Rwkv7Field::RECEPTANCE], &wk = t[Rwkv7Field::KEY], &wv = t[Rwkv7Field::VALUE];
  const int64_t qr = q[Rwkv7Matrix::RECEPTANCE], qk = q[Rwkv7Matrix::KEY], qv = q[Rwkv7Matrix::VALUE];
  MixProducts o;
  if (M >= step::kLowRankRows || qr != -1 || qk != -1 || qv != -1) {
    auto part = [&](int i) { return mix[i]; };  // [M, C]
    o.r = product(part(0), wr, qr, sl.of(j + Rwkv7Matrix::RECEPTANCE));
    o.k = product(part(2), wk, qk, sl.of(j + Rwkv7Matrix::KEY));
    o.v = product(part(3), wv, qv, sl.of(j + Rwkv7Matrix::VALUE));
    o.dw = lora(step::map_(lora(part(1), t[Rwkv7Field::W1]), step::tanh_), t[Rwkv7Field::W2]);
    o.da = lora(lora(part(4), t[Rwkv7Field::A1]), t[Rwkv7Field::A2]);
    o.g = lora(step::map_(lora(part(5), t[Rwkv7Field::G1]), sigmoid), t[Rwkv7Field::G2]);
    if (!first) o.dv = lora(lora(part(3), t[Rwkv7Field::V1]), t[Rwkv7Field::V2]);
    return o;
  }
  // Few rows of plain matrices: r, k, v beside the low-rank first factors in one parallel region, then the
  // second factors in another (rows::products): on one thread each, the low-rank products stream nearly as
  // fast as the big ones on every thread, so they share the big ones' regions instead of adding their own.
  const auto opts = mix.options();
  const float* xp = mix.data_ptr<float>();
  auto out = [&](const at::Tensor& w) { return at::empty({M, w.size(0)}, opts); };
  auto job = [&](const float* x, const at::Tensor& w, const at::Tensor& y) {
    return rows::Job{x, w.size(1), w.data_ptr<float>(), w.stride(0), w.size(0), w.size(1), y.data_ptr<float>()};
  };
  auto input = [&](int i) { return xp + i * M * C; };
  o.r = out(wr), o.k = out(wk), o.v = out(wv);
  at::Tensor w1 = out(t[Rwkv7Field::W1]), a1 = out(t[Rwkv7Field::A1]), g1 = out(t[Rwkv7Field::G1]), v1;
  std::vector<rows::Job> jobs = {job(input(0), wr, o.r),
                                 job(input(2), wk, o.k),
                                 job(input(3), wv, o.v),
                                 job(input(1), t[Rwkv7Field::W1], w1),
                                 job(input(4), t[Rwkv7Field::A1], a1),
                                 job(input(5), t[Rwkv7Field::G1], g1)};
  if (!first) {
    v1 = out(t[Rwkv7Field::V1]);
    jobs.push_back(job(input(3), t[Rwkv7Field::V1], v1));
  }
  rows::products(jobs, M);
  step::map_(w1, step::tanh_);
  step::map_(g1, sigmoid);
  o.dw = out(t[Rwkv7Field::W2]), o.da = out(t[Rwkv7Field::A2]), o.g = out(t[Rwkv7Field::G2]);
  jobs = {job(w1.data_ptr<float>(), t[Rwkv7Field::W2], o.dw), job(a1.data_ptr<float>(), t[Rwkv7Field::A2], o.da),
          job(g1.data_ptr<float>(), t[Rwkv7Field::G2], o.g)};
  if (!first) {
    o.dv = out(t[Rwkv7Field::V2]);
    jobs.push_back(job(v1.data_ptr<float>(), t[Rwkv7Field::V2], o.dv));
  }
  rows::products(jobs, M);
  return o;
}

at::Tensor rwkv7_step(const at::Tensor& x_in, at::TensorList layers, at::IntArrayRef qtypes,
                      const at::Tensor& norm_f, const at::Tensor& head, int64_t head_qtype, double eps,
                      int64_t n_head, const at::Tensor& emb_norm, const at::Tensor& emb_norm_b,
                      const at::Tensor& norm_f_b, at::TensorList slices, int64_t n_slices) {
  TORCH_CHECK_VALUE(layers.size() % kLayerTensors == 0 && qtypes.size() * kLayerTensors == kQtypes * layers.size(),
                    kOp, ": ", kLayerTensors, " tensors and ", kQtypes, " qtypes a layer, got ", layers.size(), " and ",
                    qtypes.size());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(0) >= 1, kOp,
                    ": x must be float32 [M, C], got ", x_in.sizes());
  const int64_t M = x_in.size(0), C = x_in.size(1);
  TORCH_CHECK_VALUE(n_head > 0 && C % n_head == 0 && C / n_head <= 256, kOp, ": ", n_head,
                    " heads do not split ", C, " channels into heads of at most 256");
  const int64_t H = n_head, N = C / H;
  const int64_t n_layer = static_cast<int64_t>(layers.size()) / kLayerTensors;
  const step::Slices sl = step::check_slices(kOp, slices, n_slices, n_layer * kQtypes + 1);
  for (int64_t il = 0; il < n_layer; ++il) {
    check_layer(layers.data() + il * kLayerTensors, qtypes.data() + il * kQtypes, il == 0, M, C, H, sl,
                il * kQtypes);
  }
  for (const at::Tensor* t : {&emb_norm, &emb_norm_b, &norm_f, &norm_f_b}) check_f32(kOp, *t, C, "a norm");
  TORCH_CHECK_VALUE(head.dim() == 2, kOp, ": head must be a matrix, got ", head.sizes());
  check_matrix(kOp, head, head_qtype, head.size(0), C, "head", sl.of(n_layer * kQtypes));

  const float feps = static_cast<float>(eps);
  const auto opts = x_in.options();
  at::Tensor x = at::empty({M, C}, opts);
  float* xp = x.data_ptr<float>();
  layer_norm_rows(x_in.contiguous().data_ptr<float>(), emb_norm.data_ptr<float>(), emb_norm_b.data_ptr<float>(),
                  xp, M, C, feps);
  at::Tensor h = at::empty({M, C}, opts), mix = at::empty({6, M, C}, opts), v_first;
  at::Tensor w = at::empty({M, C}, opts), a = at::empty({M, C}, opts), kk = at::empty({M, C}, opts);
  at::Tensor y = at::empty({M, C}, opts);
  float *hp = h.data_ptr<float>(), *mp = mix.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *ap = a.data_ptr<float>(), *kkp = kk.data_ptr<float>(), *yp = y.data_ptr<float>();
  for (int64_t il = 0; il < n_layer; ++il) {
    const at::Tensor* t = layers.data() + il * kLayerTensors;
    const int64_t* q = qtypes.data() + il * kQtypes;
    auto vec = [&](int64_t i) { return t[i].data_ptr<float>(); };
    auto slices_of = [&](int64_t m) { return sl.of(il * kQtypes + m); };
    float* shift = t[Rwkv7Field::SHIFT].data_ptr<float>();
    const float* lerp = vec(Rwkv7Field::LERP);
    step::each_row(M, 8 * C, [&](int64_t m) {
      float* hm = hp + m * C;
      const float* prev = shift + m * 2 * C;
      step::layer_norm_row(xp + m * C, vec(Rwkv7Field::ATTN_NORM), vec(Rwkv7Field::ATTN_NORM_B), hm, C, feps);
      for (int i = 0; i < 6; ++i) {
        float* out = mp + (i * M + m) * C;
        for (int64_t j = 0; j < C; ++j) out[j] = hm[j] + (prev[j] - hm[j]) * lerp[i * C + j];
      }
    });
    const MixProducts mixed = mix_products(t, q, mix, il == 0, sl, il * kQtypes);
    at::Tensor r = mixed.r, k = mixed.k, v = mixed.v;
    const at::Tensor dw = mixed.dw, da = mixed.da, g = mixed.g, dv = mixed.dv;
    float *rp = r.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
    const float *dwp = dw.data_ptr<float>(), *dap = da.data_ptr<float>();
    const float *w0 = vec(Rwkv7Field::W0), *a0 = vec(Rwkv7Field::A0), *k_k = vec(Rwkv7Field::K_K);
    const float *k_a = vec(Rwkv7Field::K_A), *r_k = vec(Rwkv7Field::R_K);
    if (il == 0) v_first = v.clone();
    const float *dvp = il > 0 ? dv.data_ptr<float>() : nullptr, *v0 = vec(Rwkv7Field::V0);
    const float* vf = v_first.data_ptr<float>();
    // per row: the decay, the in-context rate, the value residual, kk and the key's update
    step::each_row(M, 6 * C, [&](int64_t m) {
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= C; j += 16) {  // std::exp one value at a time: a visible share of a wide step
        const int64_t e = m * C + j;
        const __m512 sw = sigmoid16(_mm512_add_ps(_mm512_loadu_ps(w0 + j), _mm512_loadu_ps(dwp + e)));
        _mm512_storeu_ps(wp + e, exp16(_mm512_mul_ps(_mm512_set1_ps(-kDecayScale), sw)));
        _mm512_storeu_ps(ap + e, sigmoid16(_mm512_add_ps(_mm512_loadu_ps(a0 + j), _mm512_loadu_ps(dap + e))));
        if (dvp != nullptr) {
          const __m512 vv = _mm512_loadu_ps(vp + e);
          const __m512 sv = sigmoid16(_mm512_add_ps(_mm512_loadu_ps(v0 + j), _mm512_loadu_ps(dvp + e)));
          _mm512_storeu_ps(vp + e, _mm512_add_ps(vv, _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(vf + e), vv), sv)));
        }
      }
#endif
      for (; j < C; ++j) {
        const int64_t e = m * C + j;
        wp[e] = std::exp(-kDecayScale * sigmoid(w0[j] + dwp[e]));
        ap[e] = sigmoid(a0[j] + dap[e]);
        if (dvp != nullptr) vp[e] += (vf[e] - vp[e]) * sigmoid(v0[j] + dvp[e]);
      }
      for (int64_t hh = 0; hh < H; ++hh) {
        const int64_t off = m * C + hh * N;
        float ss = 0.f;
        for (int64_t j = 0; j < N; ++j) {
          kkp[off + j] = kp[off + j] * k_k[hh * N + j];
          ss += kkp[off + j] * kkp[off + j];
        }
        const float inv = 1.f / std::max(std::sqrt(ss), 1e-12f);
        for (int64_t j = 0; j < N; ++j) kkp[off + j] *= inv;
        for (int64_t j = 0; j < N; ++j) kp[off + j] *= 1.f + (ap[off + j] - 1.f) * k_a[hh * N + j];
      }
    });
    wkv7(vec(Rwkv7Field::WKV), rp, wp, kp, vp, kkp, ap, yp, M, H, N);
    const float *ln_w = vec(Rwkv7Field::LN_X), *ln_b = vec(Rwkv7Field::LN_X_B), *gp = g.data_ptr<float>();
    step::each_row(M, 4 * C, [&](int64_t m) {
      for (int64_t hh = 0; hh < H; ++hh) {
        const int64_t off = m * C + hh * N;
        float* yh = yp + off;
        float mean = 0.f, var = 0.f, bonus = 0.f;
        for (int64_t j = 0; j < N; ++j) mean += yh[j];
        mean /= static_cast<float>(N);
        for (int64_t j = 0; j < N; ++j) var += (yh[j] - mean) * (yh[j] - mean);
        const float inv = 1.f / std::sqrt(var / static_cast<float>(N) + kGroupNormEps);
        for (int64_t j = 0; j < N; ++j) bonus += rp[off + j] * kp[off + j] * r_k[hh * N + j];
        for (int64_t j = 0; j < N; ++j) {
          const int64_t c = hh * N + j;
          yh[j] = ((yh[j] - mean) * inv * ln_w[c] + ln_b[c] + bonus * vp[off + j]) * gp[off + j];
        }
      }
    });
    step::add_product(xp, y, t[Rwkv7Field::OUTPUT], q[Rwkv7Matrix::OUTPUT], slices_of(Rwkv7Matrix::OUTPUT));
    // the channel mix; the shift rows take this token's normed inputs
    at::Tensor f = at::empty({M, C}, opts), fk = at::empty({M, C}, opts);
    float *fp = f.data_ptr<float>(), *fkp = fk.data_ptr<float>();
    const float* lerp_k = vec(Rwkv7Field::FFN_LERP_K);
    step::each_row(M, 4 * C, [&](int64_t m) {
      float* prev = shift + m * 2 * C;
      step::layer_norm_row(xp + m * C, vec(Rwkv7Field::FFN_NORM), vec(Rwkv7Field::FFN_NORM_B), fp + m * C, C, feps);
      for (int64_t j = 0; j < C; ++j) {
        const int64_t e = m * C + j;
        fkp[e] = fp[e] + (prev[C + j] - fp[e]) * lerp_k[j];
        prev[j] = hp[e];
        prev[C + j] = fp[e];
      }
    });
    at::Tensor kf = product(fk, t[Rwkv7Field::FFN_KEY], q[Rwkv7Matrix::FFN_KEY], slices_of(Rwkv7Matrix::FFN_KEY));
    float* kfp = kf.data_ptr<float>();
    const int64_t F = kf.size(1);
    step::each_row(M, F, [&](int64_t m) {
      for (int64_t e = m * F; e < (m + 1) * F; ++e) kfp[e] = kfp[e] > 0.f ? kfp[e] * kfp[e] : 0.f;
    });
    step::add_product(xp, kf, t[Rwkv7Field::FFN_VALUE], q[Rwkv7Matrix::FFN_VALUE], slices_of(Rwkv7Matrix::FFN_VALUE));
  }
  layer_norm_rows(xp, norm_f.data_ptr<float>(), norm_f_b.data_ptr<float>(), hp, M, C, feps);
  return product(h, head, head_qtype, sl.of(n_layer * kQtypes));
}

}  // namespace
}  // namespace rsmem

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def(
      "rwkv7_step(Tensor x, Tensor[] layers, int[] qtypes, Tensor norm_f, Tensor head, int head_qtype, "
      "float eps, int n_head, Tensor emb_norm, Tensor emb_norm_b, Tensor norm_f_b, Tensor[] slices, "
      "int n_slices) -> Tensor",
      &rsmem::rwkv7_step);
}
