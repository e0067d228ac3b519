// RWKV-6's one-token decode step in C++, as rwkv7_step.cpp is RWKV-7's: one op call a token of one or a few
// sequences.
//
//   rwkv6_step(x [M, C], layers: 26 tensors a layer, qtypes [8 a layer: receptance, key, value, gate,
//       output, ffn_key, ffn_value, ffn_receptance], norm_f, head, head_qtype, eps, n_head, rescale_every,
//       emb_norm, emb_norm_b, norm_f_b, slices, n_slices) -> logits [M, n_vocab]
// (the matrices' forms and `slices` as in rwkv7_step.cpp)
//
// A layer's tensors (Rwkv6Field) are rsmem.models.step.operands.RWKV6_FIELDS, then its token-shift rows
// [M, 2, C] and WKV state [M, H, N(k), N(v)], both updated in place:
//   attn_norm, attn_norm_b, ffn_norm, ffn_norm_b, lerp_x, lerp [5, C] (w, k, v, r, g), w1 [5 E, C],
//   w2 [5, C, E], decay, decay_w1 [Ed, C], decay_w2 [C, Ed], first (u) [C], receptance, key, value, gate,
//   output, ln_x, ln_x_b, ffn_lerp_k, ffn_lerp_r, ffn_key [F, C], ffn_value [C, F], ffn_receptance [C, C]
// Per layer, as llama.cpp's rwkv6 graph: h = layer_norm(x), sx = shift - h; the data-dependent lerps
// x + sx (lerp_i + w2_i tanh((h + sx lerp_x) w1^T)_i); r, k, v, g = silu(xg gate^T); the decay
// w = exp(-exp(decay + tanh(xw decay_w1^T) decay_w2^T)); per head y = S^T r + (r . u k) v, then
// S = diag(w) S + k v^T; group norm (eps 64e-5) of each head; x += (y g) output^T; the channel mix
// f = layer_norm(x), x += sigmoid(xr ffn_receptance^T) * (relu(xk ffn_key^T)^2 ffn_value^T); the residual
// halved after every rescale_every-th layer (0: never).
//
// Reference twin: rsmem.models.step.wkv_fused.rwkv6_token_one_ (tests/kernels/test_rwkv_step.py).
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
using step::layer_norm_rows;
using step::lora;
using step::product;
using step::sigmoid;
using step::silu;

constexpr const char* kOp = "rwkv6 step";

// A layer's operands, named as rsmem.models.step.operands.RWKV6's (step_common.h)
struct Rwkv6Field {
  enum : int64_t {
    ATTN_NORM, ATTN_NORM_B, FFN_NORM, FFN_NORM_B, LERP_X, LERP, W1, W2, DECAY, DECAY_W1, DECAY_W2, FIRST,
    RECEPTANCE, KEY, VALUE, GATE, OUTPUT, LN_X, LN_X_B, FFN_LERP_K, FFN_LERP_R, FFN_KEY, FFN_VALUE,
    FFN_RECEPTANCE, SHIFT, WKV, N_FIELDS
  };
};
struct Rwkv6Matrix {
  enum : int64_t { RECEPTANCE, KEY, VALUE, GATE, OUTPUT, FFN_KEY, FFN_VALUE, FFN_RECEPTANCE, N_MATRICES };
};
constexpr int64_t kLayerTensors = Rwkv6Field::N_FIELDS;
constexpr int64_t kQtypes = Rwkv6Matrix::N_MATRICES;
constexpr float kGroupNormEps = 64e-5f;

void check_layer(const at::Tensor* t, const int64_t* q, int64_t M, int64_t C, int64_t H, const step::Slices& sl,
                 int64_t j) {
  const int64_t N = C / H;
  for (int64_t i : {Rwkv6Field::ATTN_NORM, Rwkv6Field::ATTN_NORM_B, Rwkv6Field::FFN_NORM, Rwkv6Field::FFN_NORM_B,
                    Rwkv6Field::LERP_X, Rwkv6Field::DECAY, Rwkv6Field::FIRST, Rwkv6Field::LN_X, Rwkv6Field::LN_X_B,
                    Rwkv6Field::FFN_LERP_K, Rwkv6Field::FFN_LERP_R}) {
    check_f32(kOp, t[i], C, "a layer's vector");
  }
  check_f32(kOp, t[Rwkv6Field::LERP], 5 * C, "lerp");
  const at::Tensor& w1 = t[Rwkv6Field::W1];
  step::check_lora(kOp, w1, -1, C, "w1");
  TORCH_CHECK_VALUE(w1.size(0) % 5 == 0, kOp, ": w1 must have 5 E rows, got ", w1.sizes());
  const int64_t E = w1.size(0) / 5;
  check_f32(kOp, t[Rwkv6Field::W2], 5 * C * E, "w2");
  step::check_lora(kOp, t[Rwkv6Field::DECAY_W1], -1, C, "decay_w1");
  step::check_lora(kOp, t[Rwkv6Field::DECAY_W2], C, t[Rwkv6Field::DECAY_W1].size(0), "decay_w2");
  auto matrix = [&](int64_t field, int64_t m, int64_t rows, int64_t cols, const char* name) {
    check_matrix(kOp, t[field], q[m], rows, cols, name, sl.of(j + m));
  };
  matrix(Rwkv6Field::RECEPTANCE, Rwkv6Matrix::RECEPTANCE, C, C, "receptance");
  matrix(Rwkv6Field::KEY, Rwkv6Matrix::KEY, C, C, "key");
  matrix(Rwkv6Field::VALUE, Rwkv6Matrix::VALUE, C, C, "value");
  matrix(Rwkv6Field::GATE, Rwkv6Matrix::GATE, C, C, "gate");
  matrix(Rwkv6Field::OUTPUT, Rwkv6Matrix::OUTPUT, C, C, "output");
  const at::Tensor& ffn_value = t[Rwkv6Field::FFN_VALUE];
  TORCH_CHECK_VALUE(ffn_value.dim() == 2 && ffn_value.size(0) == C, kOp, ": ffn_value must be [", C, ", F], got ",
                    ffn_value.sizes());
  const int64_t F = ffn_value.size(1);
  matrix(Rwkv6Field::FFN_KEY, Rwkv6Matrix::FFN_KEY, F, C, "ffn_key");
  matrix(Rwkv6Field::FFN_VALUE, Rwkv6Matrix::FFN_VALUE, C, F, "ffn_value");
  matrix(Rwkv6Field::FFN_RECEPTANCE, Rwkv6Matrix::FFN_RECEPTANCE, C, C, "ffn_receptance");
  check_f32(kOp, t[Rwkv6Field::SHIFT], M * 2 * C, "shift");
  check_f32(kOp, t[Rwkv6Field::WKV], M * H * N * N, "wkv");
}

// r, k, v, g of a layer's mixed inputs (w, k, v, r, g: mix [5, M, C]) and the decay's low-rank term dw (tanh
// between the factors). Few rows of plain matrices: r, k, v, g beside the low-rank first factor in one
// parallel region (rows::products; on its own that factor ran on one thread), the second factor after.
struct MixProducts {
  at::Tensor r, k, v, g, dw;
};

MixProducts mix_products(const at::Tensor* t, const int64_t* q, const at::Tensor& mix, const step::Slices& sl,
                         int64_t j) {
  const int64_t M = mix.size(1), C = mix.size(2);
  const at::Tensor &wr = t[Rwkv6Field::RECEPTANCE], &wk = t[Rwkv6Field::KEY], &wv = t[Rwkv6Field::VALUE];
  const at::Tensor &wg = t[Rwkv6Field::GATE], &decay_w1 = t[Rwkv6Field::DECAY_W1], &decay_w2 = t[Rwkv6Field::DECAY_W2];
  const int64_t qr = q[Rwkv6Matrix::RECEPTANCE], qk = q[Rwkv6Matrix::KEY], qv = q[Rwkv6Matrix::VALUE];
  const int64_t qg = q[Rwkv6Matrix::GATE];
  MixProducts o;
  if (M >= step::kLowRankRows || qr != -1 || qk != -1 || qv != -1 || qg != -1) {
    auto part = [&](int i) { return mix[i]; };  // [M, C]
    o.r = product(part(3), wr, qr, sl.of(j + Rwkv6Matrix::RECEPTANCE));
    o.k = product(part(1), wk, qk, sl.of(j + Rwkv6Matrix::KEY));
    o.v = product(part(2), wv, qv, sl.of(j + Rwkv6Matrix::VALUE));
    o.g = product(part(4), wg, qg, sl.of(j + Rwkv6Matrix::GATE));
    o.dw = lora(step::map_(lora(part(0), decay_w1), step::tanh_), decay_w2);
    return o;
  }
  const float* xp = mix.data_ptr<float>();
  auto out = [&](const at::Tensor& w) { return at::empty({M, w.size(0)}, mix.options()); };
  auto job = [&](int i, const at::Tensor& w, const at::Tensor& y) {
    return rows::Job{xp + i * M * C, C, w.data_ptr<float>(), w.stride(0), w.size(0), C, y.data_ptr<float>()};
  };
  o.r = out(wr), o.k = out(wk), o.v = out(wv), o.g = out(wg);
  const at::Tensor w1 = out(decay_w1);
  rows::products({job(3, wr, o.r), job(1, wk, o.k), job(2, wv, o.v), job(4, wg, o.g), job(0, decay_w1, w1)}, M);
  o.dw = lora(step::map_(w1, step::tanh_), decay_w2);
  return o;
}

// y = S^T r + (r . u k) v, then S = diag(w) S + k v^T, for every (sequence, head): S [N(k), N(v)]
void wkv6(float* S, const float* r, const float* w, const float* k, const float* v, const float* u, float* y,
          int64_t M, int64_t H, int64_t N) {
  const int64_t C = H * N;
  pool::parallel_for(0, M * H, std::max<int64_t>(1, 4096 / (N * N)), [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t off = (i / H) * C + (i % H) * N;
      wkv::token6(S + i * N * N, r + off, w + off, k + off, v + off, u + (i % H) * N, y + off, N);
    }
  });
}

at::Tensor rwkv6_step(const at::Tensor& x_in, at::TensorList layers, at::IntArrayRef qtypes,
                      const at::Tensor& norm_f, const at::Tensor& head, int64_t head_qtype, double eps,
                      int64_t n_head, int64_t rescale_every, const at::Tensor& emb_norm,
                      const at::Tensor& emb_norm_b, const at::Tensor& norm_f_b, at::TensorList slices,
                      int64_t n_slices) {
  TORCH_CHECK_VALUE(layers.size() % kLayerTensors == 0 && qtypes.size() * kLayerTensors == kQtypes * layers.size(),
                    kOp, ": ", kLayerTensors, " tensors and ", kQtypes, " qtypes a layer, got ", layers.size(), " and ",
                    qtypes.size());
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(0) >= 1, kOp,
                    ": x must be float32 [M, C], got ", x_in.sizes());
  const int64_t M = x_in.size(0), C = x_in.size(1);
  TORCH_CHECK_VALUE(n_head > 0 && C % n_head == 0, kOp, ": ", n_head, " heads do not split ", C, " channels");
  const int64_t H = n_head, N = C / H;
  const int64_t n_layer = static_cast<int64_t>(layers.size()) / kLayerTensors;
  const step::Slices sl = step::check_slices(kOp, slices, n_slices, n_layer * kQtypes + 1);
  for (int64_t il = 0; il < n_layer; ++il) {
    check_layer(layers.data() + il * kLayerTensors, qtypes.data() + il * kQtypes, M, C, H, sl, il * kQtypes);
  }
  for (const at::Tensor* t : {&emb_norm, &emb_norm_b, &norm_f, &norm_f_b}) check_f32(kOp, *t, C, "a norm");
  TORCH_CHECK_VALUE(head.dim() == 2, kOp, ": head must be a matrix, got ", head.sizes());
  check_matrix(kOp, head, head_qtype, head.size(0), C, "head", sl.of(n_layer * kQtypes));

  const float feps = static_cast<float>(eps);
  const auto opts = x_in.options();
  at::Tensor x = at::empty({M, C}, opts), h = at::empty({M, C}, opts), f = at::empty({M, C}, opts);
  at::Tensor base = at::empty({M, C}, opts), mix = at::empty({5, M, C}, opts), w = at::empty({M, C}, opts);
  at::Tensor y = at::empty({M, C}, opts), fk = at::empty({M, C}, opts), fr = at::empty({M, C}, opts);
  float *xp = x.data_ptr<float>(), *hp = h.data_ptr<float>(), *fp = f.data_ptr<float>();
  float *bp = base.data_ptr<float>(), *mp = mix.data_ptr<float>(), *wp = w.data_ptr<float>();
  float *yp = y.data_ptr<float>(), *fkp = fk.data_ptr<float>(), *frp = fr.data_ptr<float>();
  layer_norm_rows(x_in.contiguous().data_ptr<float>(), emb_norm.data_ptr<float>(), emb_norm_b.data_ptr<float>(),
                  xp, M, C, feps);
  for (int64_t il = 0; il < n_layer; ++il) {
    const at::Tensor* t = layers.data() + il * kLayerTensors;
    const int64_t* q = qtypes.data() + il * kQtypes;
    auto slices_of = [&](int64_t m) { return sl.of(il * kQtypes + m); };
    auto vec = [&](int64_t i) { return t[i].data_ptr<float>(); };
    float* shift = t[Rwkv6Field::SHIFT].data_ptr<float>();
    const float *lerp_x = vec(Rwkv6Field::LERP_X), *lerp = vec(Rwkv6Field::LERP);
    step::each_row(M, 3 * C, [&](int64_t m) {
      step::layer_norm_row(xp + m * C, vec(Rwkv6Field::ATTN_NORM), vec(Rwkv6Field::ATTN_NORM_B), hp + m * C, C, feps);
      for (int64_t j = 0; j < C; ++j) {
        const int64_t e = m * C + j;
        bp[e] = hp[e] + (shift[m * 2 * C + j] - hp[e]) * lerp_x[j];
      }
    });
    const at::Tensor mixer = step::map_(lora(base, t[Rwkv6Field::W1]), step::tanh_);  // [M, 5 E]
    const int64_t E = t[Rwkv6Field::W1].size(0) / 5;
    const float *mx = mixer.data_ptr<float>(), *w2 = vec(Rwkv6Field::W2);
    // each (row, mixed input) a unit of work shared between rsmem's workers (one sequence's five are too)
    pool::parallel_for(0, M * 5, std::max<int64_t>(1, step::kRowWorkGrain / (C * E)), [&](int64_t u0, int64_t u1) {
      for (int64_t u = u0; u < u1; ++u) {
        const int64_t m = u / 5, i = u % 5;
        const float* me = mx + m * 5 * E + i * E;
        float* out = mp + (i * M + m) * C;
        for (int64_t j = 0; j < C; ++j) {
          const float* w2r = w2 + (i * C + j) * E;
          float off = 0.f;
#pragma omp simd reduction(+ : off)
          for (int64_t e = 0; e < E; ++e) off += w2r[e] * me[e];
          const int64_t at = m * C + j;
          out[j] = hp[at] + (shift[m * 2 * C + j] - hp[at]) * (off + lerp[i * C + j]);
        }
      }
    });
    const MixProducts mixed = mix_products(t, q, mix, sl, il * kQtypes);
    const at::Tensor &r = mixed.r, &k = mixed.k, &v = mixed.v, &g = mixed.g, &dw = mixed.dw;
    const float *dwp = dw.data_ptr<float>(), *decay = vec(Rwkv6Field::DECAY);
    step::each_row(M, 8 * C, [&](int64_t m) {
      int64_t j = 0;
#if defined(__AVX512F__)
      for (; j + 16 <= C; j += 16) {  // std::exp one value at a time
        const __m512 z = _mm512_add_ps(_mm512_loadu_ps(decay + j), _mm512_loadu_ps(dwp + m * C + j));
        _mm512_storeu_ps(wp + m * C + j, exp16(_mm512_sub_ps(_mm512_setzero_ps(), exp16(z))));
      }
#endif
      for (; j < C; ++j) wp[m * C + j] = std::exp(-std::exp(decay[j] + dwp[m * C + j]));
    });
    wkv6(vec(Rwkv6Field::WKV), r.data_ptr<float>(), wp, k.data_ptr<float>(), v.data_ptr<float>(),
         vec(Rwkv6Field::FIRST), yp, M, H, N);
    const float *ln_w = vec(Rwkv6Field::LN_X), *ln_b = vec(Rwkv6Field::LN_X_B);
    float* gp = g.data_ptr<float>();
    step::each_row(M, 4 * C, [&](int64_t m) {
      for (int64_t hh = 0; hh < H; ++hh) {
        float* yh = yp + m * C + hh * N;
        float mean = 0.f, var = 0.f;
        for (int64_t j = 0; j < N; ++j) mean += yh[j];
        mean /= static_cast<float>(N);
        for (int64_t j = 0; j < N; ++j) var += (yh[j] - mean) * (yh[j] - mean);
        const float inv = 1.f / std::sqrt(var / static_cast<float>(N) + kGroupNormEps);
        int64_t j = 0;
#if defined(__AVX512F__)
        for (; j + 16 <= N; j += 16) {
          const int64_t c = hh * N + j;
          const __m512 gv = _mm512_loadu_ps(gp + m * C + c);
          const __m512 nv = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(yh + j), _mm512_set1_ps(mean)),
                                                          _mm512_set1_ps(inv)),
                                            _mm512_loadu_ps(ln_w + c), _mm512_loadu_ps(ln_b + c));
          _mm512_storeu_ps(yh + j, _mm512_mul_ps(nv, _mm512_mul_ps(gv, sigmoid16(gv))));
        }
#endif
        for (; j < N; ++j) {
          const int64_t c = hh * N + j;
          yh[j] = ((yh[j] - mean) * inv * ln_w[c] + ln_b[c]) * silu(gp[m * C + c]);
        }
      }
    });
    step::add_product(xp, y, t[Rwkv6Field::OUTPUT], q[Rwkv6Matrix::OUTPUT], slices_of(Rwkv6Matrix::OUTPUT));
    // the channel mix; the shift rows take this token's normed inputs
    const float *lerp_k = vec(Rwkv6Field::FFN_LERP_K), *lerp_r = vec(Rwkv6Field::FFN_LERP_R);
    step::each_row(M, 4 * C, [&](int64_t m) {
      float* prev = shift + m * 2 * C;
      step::layer_norm_row(xp + m * C, vec(Rwkv6Field::FFN_NORM), vec(Rwkv6Field::FFN_NORM_B), fp + m * C, C, feps);
      for (int64_t j = 0; j < C; ++j) {
        const int64_t e = m * C + j;
        const float sx = prev[C + j] - fp[e];
        fkp[e] = fp[e] + sx * lerp_k[j];
        frp[e] = fp[e] + sx * lerp_r[j];
        prev[j] = hp[e];
        prev[C + j] = fp[e];
      }
    });
    const at::Tensor rf = product(fr, t[Rwkv6Field::FFN_RECEPTANCE], q[Rwkv6Matrix::FFN_RECEPTANCE],
                                  slices_of(Rwkv6Matrix::FFN_RECEPTANCE));
    at::Tensor kf = product(fk, t[Rwkv6Field::FFN_KEY], q[Rwkv6Matrix::FFN_KEY], slices_of(Rwkv6Matrix::FFN_KEY));
    float* kfp = kf.data_ptr<float>();
    const int64_t F = kf.size(1);
    step::each_row(M, F, [&](int64_t m) {
      for (int64_t e = m * F; e < (m + 1) * F; ++e) kfp[e] = kfp[e] > 0.f ? kfp[e] * kfp[e] : 0.f;
    });
    const at::Tensor out =
        product(kf, t[Rwkv6Field::FFN_VALUE], q[Rwkv6Matrix::FFN_VALUE], slices_of(Rwkv6Matrix::FFN_VALUE));
    const float *op = out.data_ptr<float>(), *rfp = rf.data_ptr<float>();
    const bool halve = rescale_every > 0 && (il + 1) % rescale_every == 0;
    step::each_row(M, 8 * C, [&](int64_t m) {
      int64_t e = m * C;
#if defined(__AVX512F__)
      for (; e + 16 <= (m + 1) * C; e += 16) {
        __m512 xv = _mm512_fmadd_ps(sigmoid16(_mm512_loadu_ps(rfp + e)), _mm512_loadu_ps(op + e), _mm512_loadu_ps(xp + e));
        if (halve) xv = _mm512_mul_ps(xv, _mm512_set1_ps(0.5f));
        _mm512_storeu_ps(xp + e, xv);
      }
#endif
      for (; e < (m + 1) * C; ++e) {
        xp[e] += sigmoid(rfp[e]) * op[e];
        if (halve) xp[e] *= 0.5f;
      }
    });
  }
  layer_norm_rows(xp, norm_f.data_ptr<float>(), norm_f_b.data_ptr<float>(), hp, M, C, feps);
  return product(h, head, head_qtype, sl.of(n_layer * kQtypes));
}

}  // namespace
}  // namespace rsmem

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def(
      "rwkv6_step(Tensor x, Tensor[] layers, int[] qtypes, Tensor norm_f, Tensor head, int head_qtype, "
      "float eps, int n_head, int rescale_every, Tensor emb_norm, Tensor emb_norm_b, Tensor norm_f_b, "
      "Tensor[] slices, int n_slices) -> Tensor",
      &rsmem::rwkv6_step);
}
