// rsmem::qmatmul for F16 and BF16 matrices (qmatmul.cpp): the rows are the file's 2-byte values, K of them
// a row (`blocks` uint8 [N, 2 K]), widened to float32 as they are used; activations and sums stay float32,
// so every route gives the float32 product x @ W^T of the widened W, only the summation order differs.
//
// Routes (`route` -1 chooses by M):
//   0 "registers" (M <= kHalfRowsMaxM): rows_kernel.h's few-row kernel, weights widened in registers as
//     they stream (vcvtph2ps; bfloat16: a 16-bit shift), the activation rows' sums in registers.
//   1 "widened chunks" (more rows: prefill, large batches): chunks of up to kHalfChunkBytes of weight rows
//     widened to float32 (most matrices in one chunk) and multiplied by oneDNN's GEMM on the plain float32
//     rows (mkldnn::_linear_pointwise; at::mm where torch has no oneDNN), a chunk at a time: a transient
//     float32 copy of the chunk per product, amortised over the rows.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <ATen/core/dispatch/Dispatcher.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "rows_kernel.h"

namespace rsmem {

enum HalfType : int64_t { kF16 = 1, kBF16 = 30 };

// Up to how many activation rows route 0 runs (more go to route 1). F16, 1 thread, CPU ms, route 0 / 1
// (float32 packed oneDNN on the widened matrix for comparison), loaded machine: [3352, 768] M=22 1.21 /
// 2.64 (1.46), M=64 3.64 / 5.03 (3.85), M=512 - / 26.8 (25.8); [1352, 256] M=22 0.189 / 0.220 (0.163),
// M=64 0.547 / 0.481 (0.415); [768, 1536] M=22 0.568 / 0.764 (0.516), M=64 1.67 / 1.76 (1.45).
constexpr int64_t kHalfRowsMaxM = 32;
// float32 bytes a chunk of route 1 widens at a time (whole rows, at least kHalfChunkMinRows of them).
constexpr int64_t kHalfChunkBytes = 16 << 20;
constexpr int64_t kHalfChunkMinRows = 64;

// Rows n0 .. n0 + rows of w (K values each) widened into `out` (row stride K).
template <class W>
void widen_rows(const uint16_t* w, int64_t n0, int64_t rows, int64_t K, float* out) {
  at::parallel_for(0, rows, std::max<int64_t>(1, (64 << 10) / (2 * K)), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint16_t* src = w + (n0 + r) * K;
      float* dst = out + r * K;
      int64_t k = 0;
#if defined(__AVX512F__) || defined(__AVX2__)
      for (; k + rows::kLanes <= K; k += rows::kLanes) {
#if defined(__AVX512F__)
        _mm512_storeu_ps(dst + k, W::load(src + k));
#else
        _mm256_storeu_ps(dst + k, W::load(src + k));
#endif
      }
#endif
      for (; k < K; ++k) dst[k] = W::value(src[k]);
    }
  });
}

// x @ w^T for float32 w [rows, K] with contiguous rows: oneDNN's product where torch has it (ahead of
// at::mm at 22-512 rows and close to its packed weights), else at::mm.
inline at::Tensor plain_linear(const at::Tensor& x, const at::Tensor& w) {
  static const std::optional<c10::OperatorHandle> op =
      c10::Dispatcher::singleton().findSchema({"mkldnn::_linear_pointwise", ""});
  if (!op.has_value()) return at::mm(x, w.t());
  std::vector<c10::IValue> stack{x, w, c10::IValue(), std::string("none"), c10::List<std::optional<at::Scalar>>(),
                                 c10::IValue()};
  op->callBoxed(stack);
  return stack[0].toTensor();
}

template <class W>
at::Tensor half_matmul(const at::Tensor& x, const at::Tensor& blocks, int64_t K, int64_t route) {
  const int64_t M = x.size(0), N = blocks.size(0);
  if (route < 0) route = M <= kHalfRowsMaxM ? 0 : 1;
  TORCH_CHECK_VALUE(route <= 1, "F16 and BF16 matrices have routes 0 and 1 only");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(blocks.data_ptr<uint8_t>());
  if (route == 0) {
    rows::product<W>(x.data_ptr<float>(), K, w, K, M, N, K, y.data_ptr<float>());
    return y;
  }
  const int64_t chunk = std::min(N, std::max(kHalfChunkMinRows, kHalfChunkBytes / (4 * K)));
  at::Tensor buf = at::empty({chunk, K}, x.options());
  for (int64_t n0 = 0; n0 < N; n0 += chunk) {
    const int64_t rows = std::min(chunk, N - n0);
    widen_rows<W>(w, n0, rows, K, buf.data_ptr<float>());
    const at::Tensor part = plain_linear(x, buf.narrow(0, 0, rows));
    if (rows == N) return part;
    y.narrow(1, n0, rows).copy_(part);
  }
  return y;
}

// The whole matrix widened to float32 [N, K] (rsmem_native::dequantize of these types).
template <class W>
at::Tensor half_widen(const at::Tensor& blocks, int64_t K) {
  at::Tensor y = at::empty({blocks.size(0), K}, blocks.options().dtype(at::kFloat));
  if (y.numel() == 0) return y;
  widen_rows<W>(reinterpret_cast<const uint16_t*>(blocks.data_ptr<uint8_t>()), 0, blocks.size(0), K,
                y.data_ptr<float>());
  return y;
}

}  // namespace rsmem
