// The sampler chain of rsmem.engine.sampling for the rows that take top-k, on one thread, in place of some
// sixty small torch operations a row:
//
//   penalize(x, rows, cols, counts, rep, presence, frequency): for each (row, token) entry, in place,
//     v = v <= 0 ? v * rep : v / rep; v = v - presence - frequency * count
//     (rsmem.engine.sampling.apply_penalties' arithmetic, element by element in float32: the same bits).
//   top_k_draw(x, rows, top_k, top_p, min_p, temperature, uniforms) -> tokens: for each listed row of x
//     [R, V] float32 (its maximum finite: the caller checked), the top_k candidates in canonical order
//     (logit descending, token id ascending), top-p against their log-sum-exp, min-p against the head,
//     temperature after the shift by the maximum, softmax, and the inverse-CDF draw of uniforms[i] over
//     float64 cumulative sums (rsmem.engine.truncation and sampling's inverse_cdf, its torch twin).
//
// The twin's exponentials and sums are torch's vectorised kernels and these are std::exp and sums in
// order, so a probability may differ in its last bits; a drawn token differs only when the draw or a
// top-p cut falls within that rounding of a boundary (tests/engine/test_native_sampler.py compares
// them). No parallel region: a few hundred candidates are not worth waking a thread on a busy machine.

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace rsmem {
namespace {

void check_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu(),
              "sampler: logits must be a [R, V] float32 CPU tensor");
  TORCH_CHECK(x.stride(1) == 1, "sampler: logits rows must be contiguous");
}

void penalize(at::Tensor x, std::vector<int64_t> rows, std::vector<int64_t> cols, std::vector<double> counts,
              std::vector<double> rep, std::vector<double> presence, std::vector<double> frequency) {
  check_rows(x);
  const size_t n = rows.size();
  TORCH_CHECK(cols.size() == n && counts.size() == n && rep.size() == n && presence.size() == n &&
                  frequency.size() == n,
              "sampler: penalize's lists differ in length");
  float* base = x.data_ptr<float>();
  const int64_t R = x.size(0), V = x.size(1), stride = x.stride(0);
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < R && cols[i] >= 0 && cols[i] < V, "sampler: entry out of range");
    float& v = base[rows[i] * stride + cols[i]];
    const float r = static_cast<float>(rep[i]);
    float w = v <= 0.0f ? v * r : v / r;
    w = w - static_cast<float>(presence[i]);
    const float fc = static_cast<float>(frequency[i]) * static_cast<float>(counts[i]);
    v = w - fc;
  }
}

// The k best (logit descending, id ascending) of a row, in that order.
void top_candidates(const float* row, int64_t V, int64_t k, std::vector<int64_t>& ids) {
  auto better = [row](int64_t a, int64_t b) { return row[a] > row[b] || (row[a] == row[b] && a < b); };
  ids.clear();
  ids.reserve(k);
  // a min-heap (by "better") of the k best so far; ids arrive in ascending order, so a later id that ties
  // the worst kept one is worse than it and never enters
  auto worse_first = [&](int64_t a, int64_t b) { return better(a, b); };
  for (int64_t i = 0; i < V; ++i) {
    if (static_cast<int64_t>(ids.size()) < k) {
      ids.push_back(i);
      std::push_heap(ids.begin(), ids.end(), worse_first);
    } else if (row[i] > row[ids.front()]) {
      std::pop_heap(ids.begin(), ids.end(), worse_first);
      ids.back() = i;
      std::push_heap(ids.begin(), ids.end(), worse_first);
    }
  }
  std::sort(ids.begin(), ids.end(), better);
}

int64_t draw_row(const float* row, int64_t V, int64_t k, float top_p, float min_p, float temperature,
                 double u, std::vector<int64_t>& ids, std::vector<float>& vals, std::vector<double>& cdf) {
  top_candidates(row, V, std::min(k, V), ids);
  const size_t n = ids.size();
  vals.resize(n);
  for (size_t j = 0; j < n; ++j) vals[j] = row[ids[j]];
  const float ninf = -std::numeric_limits<float>::infinity();
  // top-p: candidate j survives iff the mass before it is < top_p (the head always does)
  if (top_p < 1.0f) {
    const float m = vals[0];
    float s = 0.0f;
    for (size_t j = 0; j < n; ++j) s += std::exp(vals[j] - m);
    const float log_norm = m + std::log(s);
    float before = 0.0f;
    for (size_t j = 0; j < n; ++j) {
      const float p = std::exp(vals[j] - log_norm);
      if (j > 0 && !(before < top_p)) vals[j] = ninf;
      before += p;
    }
  }
  // min-p: drop candidates below min_p times the head's probability, in logit space
  const float threshold = vals[0] + std::log(min_p);
  for (size_t j = 0; j < n; ++j)
    if (vals[j] < threshold) vals[j] = ninf;
  // temperature after the shift by the maximum, then softmax
  const float head = vals[0];
  float mx = ninf;
  for (size_t j = 0; j < n; ++j) {
    vals[j] = (vals[j] - head) / temperature;
    mx = std::max(mx, vals[j]);
  }
  float total = 0.0f;
  for (size_t j = 0; j < n; ++j) {
    vals[j] = std::exp(vals[j] - mx);
    total += vals[j];
  }
  cdf.resize(n);
  double acc = 0.0;
  for (size_t j = 0; j < n; ++j) {
    acc += static_cast<double>(vals[j] / total);
    cdf[j] = acc;
  }
  const double target = u * cdf[n - 1];
  const size_t pos = std::upper_bound(cdf.begin(), cdf.end(), target) - cdf.begin();
  if (pos < n) return ids[pos];
  for (size_t j = n; j-- > 0;)  // u * total rounded up to the total: the last candidate with mass
    if (vals[j] > 0.0f) return ids[j];
  return ids[0];
}

std::vector<int64_t> top_k_draw(const at::Tensor& x, std::vector<int64_t> rows, std::vector<int64_t> top_k,
                                std::vector<double> top_p, std::vector<double> min_p,
                                std::vector<double> temperature, std::vector<double> uniforms) {
  check_rows(x);
  const size_t n = rows.size();
  TORCH_CHECK(top_k.size() == n && top_p.size() == n && min_p.size() == n && temperature.size() == n &&
                  uniforms.size() == n,
              "sampler: top_k_draw's lists differ in length");
  const float* base = x.data_ptr<float>();
  const int64_t R = x.size(0), V = x.size(1), stride = x.stride(0);
  std::vector<int64_t> tokens(n), ids;
  std::vector<float> vals;
  std::vector<double> cdf;
  for (size_t i = 0; i < n; ++i) {
    TORCH_CHECK(rows[i] >= 0 && rows[i] < R && top_k[i] > 0 && temperature[i] > 0.0,
                "sampler: bad row, top_k or temperature");
    tokens[i] = draw_row(base + rows[i] * stride, V, top_k[i], static_cast<float>(top_p[i]),
                         static_cast<float>(min_p[i]), static_cast<float>(temperature[i]), uniforms[i], ids,
                         vals, cdf);
  }
  return tokens;
}

}  // namespace
}  // namespace rsmem

TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def(
      "sampler_penalize(Tensor(a!) x, int[] rows, int[] cols, float[] counts, float[] rep, float[] presence, "
      "float[] frequency) -> ()",
      &rsmem::penalize);
  m.def(
      "sampler_top_k_draw(Tensor x, int[] rows, int[] top_k, float[] top_p, float[] min_p, float[] temperature, "
      "float[] uniforms) -> int[]",
      &rsmem::top_k_draw);
}
