// Few-row float32 products y = x @ w^T for x [M, K] (M = 1..16 activation rows, e.g. one token of each of
// a few sequences) and w [N, K] row-major float32 (a model's [out, in] matrix), streaming w once: the
// kernel of rows_kernel.h with float32 weights.
//
// At a few rows oneDNN's packed product reads a model's matrices at a fraction of the one-row GEMV's rate;
// this kernel is for the row counts where it is the faster (the caller decides).
// Its reference twin is x @ w.t() (rsmem.models.step.small_rows.rows_ref; tests/kernels/test_rows_f32.py).

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "rows_kernel.h"

namespace rsmem {
namespace {

at::Tensor rows_f32(const at::Tensor& x_in, const at::Tensor& w) {
  TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && w.scalar_type() == at::kFloat,
                    "rows_f32: float32 x and w");
  TORCH_CHECK_VALUE(x_in.dim() == 2 && w.dim() == 2 && x_in.size(1) == w.size(1),
                    "rows_f32: x [M, K] and w [N, K], got ", x_in.sizes(), " and ", w.sizes());
  TORCH_CHECK_VALUE(x_in.device().is_cpu() && w.device().is_cpu(), "rows_f32: CPU tensors");
  TORCH_CHECK_VALUE(w.stride(1) == 1 || w.size(1) <= 1, "rows_f32: w's rows must be contiguous");
  const at::Tensor x = x_in.stride(-1) == 1 ? x_in : x_in.contiguous();
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  const int64_t ldw = w.size(1) <= 1 ? K : w.stride(0);
  rows::product<rows::F32W>(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), ldw, M, N, K, y.data_ptr<float>());
  return y;
}

// x @ w^T through rows_f32 for up to max_rows rows, else through oneDNN's product with `packed` (w's packed
// twin, torch.ops.mkldnn._reorder_linear_weight): one op for a compiled step with a dynamic batch, which
// then needs no guard on the row count.
at::Tensor rows_linear(const at::Tensor& x, const at::Tensor& w, const at::Tensor& packed, int64_t max_rows) {
  if (x.dim() == 2 && x.size(0) <= max_rows) return rows_f32(x, w);
  return rows::packed_product(x, packed);
}

}  // namespace
}  // namespace rsmem

#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif

// Implemented as explicit composites (a packed twin is an MkldnnCPU tensor; an implicit composite, what
// m.def with a function gives, may not have a fake), so that rsmem.models.step.small_rows can give them fake
// implementations and compiled graphs call them as they are.
TORCH_LIBRARY_FRAGMENT(RSMEM_OPS_NS, m) {
  m.def("rows_f32(Tensor x, Tensor w) -> Tensor");
  m.def("rows_linear(Tensor x, Tensor w, Tensor packed, int max_rows) -> Tensor");
}

TORCH_LIBRARY_IMPL(RSMEM_OPS_NS, CompositeExplicitAutograd, m) {
  m.impl("rows_f32", &rsmem::rows_f32);
  m.impl("rows_linear", &rsmem::rows_linear);
}
