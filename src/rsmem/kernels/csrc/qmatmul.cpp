// rsmem's products with matrices held in ggml's block form: y[M, N] = x[M, K] @ W[N, K]^T, W as uint8
// rows of blocks. Registered as torch ops rsmem_native::qmatmul / dequantize / isa (no pybind: loaded with
// torch.ops.load_library). Threaded with at::parallel_for over weight rows (torch.set_num_threads).
//
// Routes (`route` -1 chooses by M):
//   0 "registers" (M < kTileMinM = 9; float_routes.h): each block of NR weight rows is dequantized into
//     registers and multiplied with up to eight float32 activation rows at a time: the reference's
//     values, summation order aside.
//   2 "bf16 tiles" (M >= 9 where AVX512-BF16 is compiled in; bf16_tiles.h): activations rounded to
//     bfloat16 once and packed 16 rows to a register; tiles of kTileRows weight rows dequantized to
//     bfloat16 in cache; vdpbf16ps (exact products, float32 sums and outputs).
//   1 "f32 tiles" (M >= 9 without AVX512-BF16; float_routes.h): tiles dequantized to float32 and multiplied with at::mm.
//   3 "int8" (Q4_K, Q5_K, Q6_K, where AVX512-VNNI is compiled in, M <= int8_registers_max_m; int8.h):
//     activations quantized to 8 bits per 256 values as llama.cpp's Q8_K, integer dot products with
//     blocks unpacked in registers. Also Q8_0 and Q4_0 where k is a multiple of 256 (int8_small.h),
//     against activations quantized per 32 values as llama.cpp's Q8_0.
//   4 "int8 panels" (the same types and k, larger M; int8_gemm.h): the same integers, weights repacked 16
//     rows at a time per task, vpdpbusd.
// F16 and BF16 matrices (their 2-byte values, widened to float32 as they are used) have their own routes 0
// (few rows, in registers) and 1 (many rows, widened tiles and at::mm): half_routes.h.
// Without AVX-512 at compile time (-march=native on another CPU) every route uses the portable scalar
// decoders of blocks.h (routes 0 and 1 only).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

#include "bf16_tiles.h"
#include "blocks.h"
#include "float_routes.h"
#include "half_routes.h"
#include "int8.h"
#include "int8_gemm.h"
#include "int8_small.h"

namespace rsmem {
namespace {

constexpr int64_t kTileMinM = 9;
// Up to how many rows Q8_0 / Q4_0 take route 3: ahead of route 0 at one row and of route 4 up to 8 rows;
// beyond, route 4's panels are the faster.
constexpr int64_t kSmallRegistersMaxM = 8;
// Up to how many rows the int8 types take route 3 (int8 in registers); beyond, route 4 (int8 panels), each
// where it is the faster: Q6_K's panels cost more to pack and sum, so it stays on route 3 longer. Both are
// faster than routes 0 and 2 at every M. Q8_0 / Q4_0 (k a multiple of 256; route 0 otherwise, or route 1 / 2
// from kTileMinM rows): route 4 is ahead of route 2 at many rows too.
template <class T>
constexpr int64_t int8_registers_max_m() {
  if constexpr (std::is_same_v<T, Q6_K>) return 24;
  if constexpr (T::BS == 32) return kSmallRegistersMaxM;
  return 8;
}

#ifdef RSMEM_BF16
constexpr int64_t kLargeRoute = 2;
#else
constexpr int64_t kLargeRoute = 1;
#endif

// Whether routes 3 and 4 (int8 activations, rsmem::i8) have a kernel for T: the K-quants (activations per
// 256 values as llama.cpp's Q8_K), and Q8_0 / Q4_0 (per 32 values as llama.cpp's Q8_0) where k is a
// multiple of 256.
template <class T>
constexpr bool has_int8() {
#ifdef RSMEM_INT8
  return true;
#else
  return false;
#endif
}

template <class T>
bool int8_takes(int64_t k) {
  return has_int8<T>() && (T::BS == 256 || k % 256 == 0);
}

template <class T>
at::Tensor run(const at::Tensor& x, const at::Tensor& blocks, int64_t k, int64_t route) {
  const int64_t M = x.size(0), N = blocks.size(0);
  TORCH_CHECK_VALUE(route != 3 || int8_takes<T>(k), "route 3 (int8) has no kernel for this type and k here");
  TORCH_CHECK_VALUE(route != 4 || int8_takes<T>(k),
                    "route 4 (int8 panels) has no kernel for this type and k here");
  if (route < 0) {
    if (int8_takes<T>(k)) {
      route = M <= int8_registers_max_m<T>() ? 3 : 4;
    } else {
      route = M < kTileMinM ? 0 : kLargeRoute;
    }
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#ifdef RSMEM_INT8
  if constexpr (has_int8<T>()) {
    if (route == 4) {
      i8::matmul_panels<T>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, k);
      return y;
    }
    if (route == 3) {
      i8::matmul<T>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, k);
      return y;
    }
  }
#endif
#ifdef RSMEM_BF16
  if (route == 2) {
    matmul_bf16<T>(x, blocks.data_ptr<uint8_t>(), y, M, N, k);
    return y;
  }
#endif
  if (route >= 1) {
    matmul_tiles<T>(x, blocks.data_ptr<uint8_t>(), y, N, k);
  } else {
    matmul_registers<T>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, k);
  }
  return y;
}

// The checks of rsmem.kernels.formats (same order, same messages), raised as Python ValueErrors.
template <class T>
void check(const at::Tensor& blocks, int64_t k, const char* name) {
  TORCH_CHECK_VALUE(k > 0 && k % T::BS == 0, "k=", k, " is not a positive multiple of ", name,
                    "'s block size ", T::BS);
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.dim() == 2,
                    "blocks must be a 2-D uint8 tensor [N, row_bytes], got ", blocks.scalar_type(),
                    " of shape ", blocks.sizes());
  TORCH_CHECK_VALUE(blocks.size(1) == k / T::BS * T::TS, "blocks have row_bytes=", blocks.size(1), ", but ",
                    name, " rows of k=", k, " values take ", k / T::BS * T::TS, " bytes");
  TORCH_CHECK_VALUE(blocks.is_contiguous(), "blocks must be contiguous (rows as the GGUF stores them)");
}

// F16 / BF16: 2-byte values, `k` of them a row.
inline void check_half(const at::Tensor& blocks, int64_t k, const char* name) {
  TORCH_CHECK_VALUE(k > 0, "k=", k, " is not a positive multiple of ", name, "'s block size 1");
  TORCH_CHECK_VALUE(blocks.scalar_type() == at::kByte && blocks.dim() == 2,
                    "blocks must be a 2-D uint8 tensor [N, row_bytes], got ", blocks.scalar_type(),
                    " of shape ", blocks.sizes());
  TORCH_CHECK_VALUE(blocks.size(1) == 2 * k, "blocks have row_bytes=", blocks.size(1), ", but ", name,
                    " rows of k=", k, " values take ", 2 * k, " bytes");
  TORCH_CHECK_VALUE(blocks.is_contiguous(), "blocks must be contiguous (rows as the GGUF stores them)");
}

// f(rows::F16W{}) or f(rows::BF16W{}) for the half types, after their checks; false for any other type.
template <class F>
bool by_half_type(int64_t qtype, const at::Tensor& blocks, int64_t k, F&& f) {
  if (qtype == kF16) {
    check_half(blocks, k, "F16");
    f(rows::F16W{});
    return true;
  }
  if (qtype == kBF16) {
    check_half(blocks, k, "BF16");
    f(rows::BF16W{});
    return true;
  }
  return false;
}

template <class F>
auto by_type(int64_t qtype, const at::Tensor& blocks, int64_t k, F&& f) {
  switch (qtype) {
    case kQ8_0: check<Q8_0>(blocks, k, "Q8_0"); return f(Q8_0{});
    case kQ4_0: check<Q4_0>(blocks, k, "Q4_0"); return f(Q4_0{});
    case kQ4_K: check<Q4_K>(blocks, k, "Q4_K"); return f(Q4_K{});
    case kQ5_K: check<Q5_K>(blocks, k, "Q5_K"); return f(Q5_K{});
    case kQ6_K: check<Q6_K>(blocks, k, "Q6_K"); return f(Q6_K{});
    default: TORCH_CHECK_VALUE(false, "qtype ", qtype,
                                  " has no kernel (kernel types: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K, F16, BF16)");
  }
}

at::Tensor qmatmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t k, int64_t route) {
  TORCH_CHECK_VALUE(route >= -1 && route <= 4, "route must be -1 (by M), 0, 1, 2, 3 or 4");
  auto check_x = [&]() {
    TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == k,
                      "x must be a float32 [M, ", k, "] tensor, got ", x_in.scalar_type(), " of shape ",
                      x_in.sizes());
    TORCH_CHECK_VALUE(x_in.device().is_cpu() && blocks.device().is_cpu(), "x and blocks must be on the CPU");
  };
  at::Tensor y;
  if (by_half_type(qtype, blocks, k, [&](auto w) {
        check_x();
        y = half_matmul<decltype(w)>(x_in.contiguous(), blocks, k, route);
      }))
    return y;
  return by_type(qtype, blocks, k, [&](auto t) {
    TORCH_CHECK_VALUE(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == k,
                      "x must be a float32 [M, ", k, "] tensor, got ", x_in.scalar_type(), " of shape ",
                      x_in.sizes());
    TORCH_CHECK_VALUE(x_in.device().is_cpu() && blocks.device().is_cpu(), "x and blocks must be on the CPU");
    return run<decltype(t)>(x_in.contiguous(), blocks, k, route);
  });
}

at::Tensor qmatmul_public(const at::Tensor& x, const at::Tensor& blocks, int64_t qtype, int64_t k) {
  return qmatmul(x, blocks, qtype, k, -1);
}

// The CPU kernel of the public op rsmem::qmatmul (defined in Python, rsmem.kernels.quant), registered
// while `on`: calls then go straight here instead of through the Python implementation. Destroying the
// Library object removes the registration (for RSMEM_KERNELS=0 decided again, and the tests).
std::unique_ptr<torch::Library>& public_registration() {
  static std::unique_ptr<torch::Library> lib;
  return lib;
}

bool set_public(bool on) {
  auto& lib = public_registration();
  if (on && !lib) {
    lib = std::make_unique<torch::Library>(torch::Library::IMPL, "rsmem", c10::DispatchKey::CPU, __FILE__,
                                           __LINE__);
    lib->impl("qmatmul", TORCH_FN(qmatmul_public));
  } else if (!on) {
    lib.reset();
  }
  return static_cast<bool>(lib);
}

at::Tensor dequantize(const at::Tensor& blocks, int64_t qtype, int64_t k) {
  at::Tensor y;
  if (by_half_type(qtype, blocks, k, [&](auto w) { y = half_widen<decltype(w)>(blocks, k); })) return y;
  return by_type(qtype, blocks, k, [&](auto t) {
    using T = decltype(t);
    const int64_t N = blocks.size(0), nb = k / T::BS, ldw = nb * T::TS;
    at::Tensor y = at::empty({N, k}, blocks.options().dtype(at::kFloat));
    const uint8_t* w = blocks.data_ptr<uint8_t>();
    float* out = y.data_ptr<float>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (int64_t n = n0; n < n1; ++n) dequant_row<T>(w + n * ldw, nb, out + n * k);
    });
    return y;
  });
}

std::string isa() {
#if defined(RSMEM_BF16) && defined(RSMEM_INT8)
  return "avx512+bf16+vnni";
#elif defined(RSMEM_BF16)
  return "avx512+bf16";
#elif defined(RSMEM_AVX512)
  return "avx512";
#else
  return "portable";
#endif
}

}  // namespace
}  // namespace rsmem

// The ops' namespace: rsmem_native, or another one for a second build (the tests' portable build).
#ifndef RSMEM_OPS_NS
#define RSMEM_OPS_NS rsmem_native
#endif

TORCH_LIBRARY(RSMEM_OPS_NS, m) {
  m.def("qmatmul(Tensor x, Tensor blocks, int qtype, int k, int route=-1) -> Tensor", &rsmem::qmatmul);
  m.def("dequantize(Tensor blocks, int qtype, int k) -> Tensor", &rsmem::dequantize);
  m.def("isa() -> str", &rsmem::isa);
  m.def("set_public(bool on) -> bool", &rsmem::set_public);
}
