// rsmem's products with matrices held in ggml's block form: y[M, N] = x[M, K] @ W[N, K]^T, W as uint8
// rows of blocks. Registered as torch ops rsmem_native::qmatmul / dequantize / isa (no pybind: loaded with
// torch.ops.load_library). Threaded with at::parallel_for over weight rows (torch.set_num_threads).
//
// Routes (`route` -1 chooses by M):
//   0 "registers" (M < kTileMinM = 9): each block of NR weight rows is dequantized into registers and
//     multiplied with up to eight float32 activation rows at a time: the reference's values, summation
//     order aside.
//   2 "bf16 tiles" (M >= 9 where AVX512-BF16 is compiled in): activations rounded to bfloat16 once and
//     packed 16 rows to a register; tiles of kTileRows weight rows dequantized to bfloat16 in cache;
//     vdpbf16ps (exact products, float32 sums and outputs).
//   1 "f32 tiles" (M >= 9 without AVX512-BF16): tiles dequantized to float32 and multiplied with at::mm.
//   3 "int8" (Q4_K, Q5_K, Q6_K, where AVX512-VNNI is compiled in, M <= int8_registers_max_m; int8.h):
//     activations quantized to 8 bits per 256 values as llama.cpp's Q8_K, integer dot products with
//     blocks unpacked in registers.
//   4 "int8 panels" (the same types, larger M; int8_gemm.h): the same integers, weights repacked 16 rows
//     at a time per task, vpdpbusd. Also Q8_0 and Q4_0 (k a multiple of 256, M >= kSmallPanelsMinM = 7),
//     against activations quantized per 32 values as llama.cpp's Q8_0.
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

#include "blocks.h"
#include "int8.h"
#include "int8_gemm.h"

namespace rsmem {
namespace {

constexpr int64_t kTileMinM = 9;
// Up to how many rows the int8 types take route 3 (int8 in registers); beyond, route 4 (int8 panels).
// Measured on in_proj [3072, 768], 1 thread, CPU time: Q4_K route 3 / 4 at M=4 0.16 / 0.19 ms, M=8 0.31 /
// 0.25; Q6_K (its panels cost more to pack and sum) M=16 0.78 / 1.00, M=64 2.83 / 2.02. Both are faster
// than routes 0 and 2 at every M (route 2 at M=512: 17.7 ms; route 4: Q4_K 8.1, Q6_K 11.2).
// Q8_0 / Q4_0 take route 4 from this many rows (k a multiple of 256): in_proj [3072, 768] Q8_0, 1 thread,
// CPU time, route 0 / 4: M=6 0.35 / 0.35 ms, M=8 0.47 / 0.38; route 2 / 4: M=64 2.2 / 1.6, M=512 17.0 / 10.4.
constexpr int64_t kSmallPanelsMinM = 7;

template <class T>
constexpr int64_t int8_registers_max_m() {
  return std::is_same_v<T, Q6_K> ? 24 : 6;
}
constexpr int64_t kTileRows = 64;
constexpr int64_t kPrefetchGroups = 2;

// Dequantize `nb` blocks of one row into y (K floats).
template <class T>
void dequant_row(const uint8_t* row, int64_t nb, float* y) {
  for (int64_t ib = 0; ib < nb; ++ib) {
#ifdef RSMEM_AVX512
    Scales s;
    T::scales(row + ib * T::TS, s);
    for (int j = 0; j < T::BS / 32; ++j) {
      __m512 w0, w1;
      Step<T>::get(row + ib * T::TS, s, j, w0, w1);
      _mm512_storeu_ps(y + ib * T::BS + 32 * j, w0);
      _mm512_storeu_ps(y + ib * T::BS + 32 * j + 16, w1);
    }
#else
    T::scalar(row + ib * T::TS, y + ib * T::BS);
#endif
  }
}

// y[m * ldy + r] = dot(x row m, W row r) for r < NR, m < MR.
template <class T, int NR, int MR>
inline void tile_dot(const uint8_t* w, int64_t ldw, int64_t nb, const float* x, int64_t ldx, float* y,
                     int64_t ldy) {
#ifdef RSMEM_AVX512
  __m512 acc[NR][MR];
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  // The rows of the group kPrefetchGroups ahead, NR * TS bytes per block: when this group is done, that
  // one is on its way from memory (a decode step streams its weights once; the hardware prefetcher follows
  // NR interleaved streams of short rows poorly).
  const uint8_t* pf = w + kPrefetchGroups * NR * ldw;
  for (int64_t ib = 0; ib < nb; ++ib) {
    for (int off = 0; off < NR * T::TS; off += 64) _mm_prefetch((const char*)(pf + ib * NR * T::TS + off), _MM_HINT_T0);
    Scales s[NR];
    for (int r = 0; r < NR; ++r) T::scales(w + r * ldw + ib * T::TS, s[r]);
    for (int j = 0; j < T::BS / 32; ++j) {
      __m512 w0[NR], w1[NR];
      for (int r = 0; r < NR; ++r) Step<T>::get(w + r * ldw + ib * T::TS, s[r], j, w0[r], w1[r]);
      const float* xj = x + ib * T::BS + 32 * j;
      for (int m = 0; m < MR; ++m) {
        const __m512 x0 = _mm512_loadu_ps(xj + m * ldx), x1 = _mm512_loadu_ps(xj + m * ldx + 16);
        for (int r = 0; r < NR; ++r) {
          acc[r][m] = _mm512_fmadd_ps(w0[r], x0, acc[r][m]);
          acc[r][m] = _mm512_fmadd_ps(w1[r], x1, acc[r][m]);
        }
      }
    }
  }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);
#else
  float acc[NR][MR][16] = {};
  float buf[T::BS];
  for (int64_t ib = 0; ib < nb; ++ib)
    for (int r = 0; r < NR; ++r) {
      T::scalar(w + r * ldw + ib * T::TS, buf);
      for (int m = 0; m < MR; ++m) {
        const float* xb = x + m * ldx + ib * T::BS;
        for (int i = 0; i < T::BS; i += 16)
          for (int l = 0; l < 16; ++l) acc[r][m][l] += buf[i + l] * xb[i + l];
      }
    }
  for (int r = 0; r < NR; ++r)
    for (int m = 0; m < MR; ++m) {
      float t = 0.f;
      for (int l = 0; l < 16; ++l) t += acc[r][m][l];
      y[m * ldy + r] = t;
    }
#endif
}

// All M activation rows against NR weight rows: in register tiles of NR x MR (NR * MR accumulators).
template <class T, int NR>
void rows_all_m(const uint8_t* w, int64_t ldw, int64_t nb, const float* x, int64_t M, int64_t K, float* y,
                int64_t N) {
  constexpr int MR = NR >= 4 ? 4 : 8;
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile_dot<T, NR, MR>(w, ldw, nb, x + m * K, K, y + m * N, N);
  const float* xm = x + m * K;
  float* ym = y + m * N;
  switch (M - m) {
    case 7: tile_dot<T, NR, 7>(w, ldw, nb, xm, K, ym, N); break;
    case 6: tile_dot<T, NR, 6>(w, ldw, nb, xm, K, ym, N); break;
    case 5: tile_dot<T, NR, 5>(w, ldw, nb, xm, K, ym, N); break;
    case 4: tile_dot<T, NR, 4>(w, ldw, nb, xm, K, ym, N); break;
    case 3: tile_dot<T, NR, 3>(w, ldw, nb, xm, K, ym, N); break;
    case 2: tile_dot<T, NR, 2>(w, ldw, nb, xm, K, ym, N); break;
    case 1: tile_dot<T, NR, 1>(w, ldw, nb, xm, K, ym, N); break;
    default: break;
  }
}

// Weight rows in groups of NR (4 for M <= 4: one pass over the weights; else 2 and eight rows of x at a
// time), and the last N % NR rows one by one.
template <class T, int NR>
void matmul_registers_nr(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t nb = K / T::BS, ldw = nb * T::TS;
  const int64_t groups = (N + NR - 1) / NR;
  // at least ~64 KB of weights per task, so small matrices are not split into tiny pieces
  const int64_t grain = std::max<int64_t>(1, kTaskBytes / std::max<int64_t>(1, ldw * NR));
  at::parallel_for(0, groups, grain, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t n0 = g * NR;
      if (n0 + NR <= N) {
        rows_all_m<T, NR>(w + n0 * ldw, ldw, nb, x, M, K, y + n0, N);
      } else {
        for (int64_t n = n0; n < N; ++n) rows_all_m<T, 1>(w + n * ldw, ldw, nb, x, M, K, y + n, N);
      }
    }
  });
}

// Whether M > 4 rows go eight at a time against two weight rows (measured faster for these types; Q6_K's
// unpacking needs more registers and is faster four at a time against four weight rows).
template <class T>
struct Wide : std::true_type {};
template <>
struct Wide<Q6_K> : std::false_type {};

template <class T>
void matmul_registers(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  if (M <= 4 || !Wide<T>::value) {
    matmul_registers_nr<T, 4>(x, w, y, M, N, K);
  } else {
    matmul_registers_nr<T, 2>(x, w, y, M, N, K);
  }
}

template <class T>
void matmul_tiles(const at::Tensor& x, const uint8_t* w, at::Tensor& y, int64_t N, int64_t K) {
  const int64_t nb = K / T::BS, ldw = nb * T::TS;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    at::Tensor buf = at::empty({kTileRows, K}, x.options());
    float* b = buf.data_ptr<float>();
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequant_row<T>(w + (n0 + r) * ldw, nb, b + r * K);
      y.narrow(1, n0, rows).copy_(at::mm(x, buf.narrow(0, 0, rows).t()));
    }
  });
}

#if defined(RSMEM_AVX512) && defined(__AVX512BF16__)
#define RSMEM_BF16 1
// Route 2: activations rounded to bfloat16 once, packed 16 rows to a zmm (a row's two neighbouring values
// in each 32-bit lane, [group][k / 2][16 rows]); weight tiles dequantized to bfloat16 rows in cache; the
// products with vdpbf16ps (exact bf16 products, float32 sums and outputs).
constexpr int kPairRows = 16;

at::Tensor pack_bf16(const float* x, int64_t M, int64_t K) {
  const int64_t groups = (M + kPairRows - 1) / kPairRows, kp = K / 2;
  at::Tensor packed = at::zeros({groups, kp, kPairRows}, at::TensorOptions().dtype(at::kInt));
  uint32_t* p = reinterpret_cast<uint32_t*>(packed.data_ptr<int32_t>());
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    alignas(64) uint32_t pairs[16];
    for (int64_t m = m0; m < m1; ++m) {
      uint32_t* dst = p + (m / kPairRows) * kp * kPairRows + m % kPairRows;
      for (int64_t k = 0; k < K; k += 32) {
        const __m512 lo = _mm512_loadu_ps(x + m * K + k), hi = _mm512_loadu_ps(x + m * K + k + 16);
        _mm512_store_si512(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        for (int i = 0; i < 16; ++i) dst[(k / 2 + i) * kPairRows] = pairs[i];
      }
    }
  });
  return packed;
}

// One row of blocks as bfloat16 values (rounded to nearest even).
template <class T>
inline void dequant_row_bf16(const uint8_t* row, int64_t nb, uint16_t* y) {
  for (int64_t ib = 0; ib < nb; ++ib) {
    Scales s;
    T::scales(row + ib * T::TS, s);
    for (int j = 0; j < T::BS / 32; ++j) {
      __m512 w0, w1;
      Step<T>::get(row + ib * T::TS, s, j, w0, w1);
      _mm512_storeu_si512(y + ib * T::BS + 32 * j, (__m512i)_mm512_cvtne2ps_pbh(w1, w0));
    }
  }
}

// y[m, n0 + r] for GM groups of 16 rows m and NW weight rows r (bf16 rows of K values at w, stride K).
template <int GM, int NW>
inline void bf16_tile(const uint32_t* xp, int64_t group_stride, const uint16_t* w, int64_t K, float* y,
                      int64_t ldy, int64_t rows_left) {
  __m512 acc[GM][NW];
  for (int g = 0; g < GM; ++g)
    for (int r = 0; r < NW; ++r) acc[g][r] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < K / 2; ++kp) {
    __m512bh xv[GM];
    for (int g = 0; g < GM; ++g)
      xv[g] = (__m512bh)_mm512_loadu_si512(xp + g * group_stride + kp * kPairRows);
    for (int r = 0; r < NW; ++r) {
      uint32_t pair;
      std::memcpy(&pair, w + r * K + 2 * kp, 4);
      const __m512bh wv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
      for (int g = 0; g < GM; ++g) acc[g][r] = _mm512_dpbf16_ps(acc[g][r], xv[g], wv);
    }
  }
  const __m512i idx = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(static_cast<int>(ldy)));
  for (int g = 0; g < GM; ++g) {
    const int64_t valid = std::min<int64_t>(kPairRows, rows_left - g * kPairRows);
    if (valid <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << valid) - 1);
    for (int r = 0; r < NW; ++r)
      _mm512_mask_i32scatter_ps(y + g * kPairRows * ldy + r, mask, idx, acc[g][r], 4);
  }
}

template <class T>
void matmul_bf16(const at::Tensor& x, const uint8_t* w, at::Tensor& y, int64_t M, int64_t N, int64_t K) {
  constexpr int NW = 8;
  const int64_t nb = K / T::BS, ldw = nb * T::TS, kp = K / 2;
  const at::Tensor packed = pack_bf16(x.data_ptr<float>(), M, K);
  const uint32_t* xp = reinterpret_cast<const uint32_t*>(packed.data_ptr<int32_t>());
  const int64_t groups = packed.size(0), group_stride = kp * kPairRows;
  const int64_t tiles = (N + kTileRows - 1) / kTileRows;
  float* out = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<uint16_t> tile(kTileRows * K);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileRows, rows = std::min(kTileRows, N - n0);
      for (int64_t r = 0; r < rows; ++r) dequant_row_bf16<T>(w + (n0 + r) * ldw, nb, tile.data() + r * K);
      for (int64_t r0 = 0; r0 < rows; r0 += NW) {
        const uint16_t* wt = tile.data() + r0 * K;
        float* yt = out + n0 + r0;
        const bool full = r0 + NW <= rows;
        for (int64_t g = 0; g < groups; g += 2) {
          const uint32_t* xg = xp + g * group_stride;
          float* yg = yt + g * kPairRows * N;
          const int64_t left = M - g * kPairRows;
          if (full && g + 2 <= groups) {
            bf16_tile<2, NW>(xg, group_stride, wt, K, yg, N, left);
          } else if (full) {
            bf16_tile<1, NW>(xg, group_stride, wt, K, yg, N, left);
          } else {
            for (int64_t r = r0; r < rows; ++r) {
              for (int64_t gg = g; gg < std::min(g + 2, groups); ++gg)
                bf16_tile<1, 1>(xp + gg * group_stride, group_stride, tile.data() + r * K, K,
                                out + n0 + r + gg * kPairRows * N, N, M - gg * kPairRows);
            }
          }
        }
      }
    }
  });
}
#endif

#ifdef RSMEM_BF16
constexpr int64_t kLargeRoute = 2;
#else
constexpr int64_t kLargeRoute = 1;
#endif

// Whether route 3 (int8 activations, rsmem::i8) has a kernel for T.
template <class T>
constexpr bool has_int8() {
#ifdef RSMEM_INT8
  return std::is_same_v<T, Q4_K> || std::is_same_v<T, Q5_K> || std::is_same_v<T, Q6_K>;
#else
  return false;
#endif
}

// Whether route 4 (int8 panels) has a kernel for T: the int8 types, and Q8_0 / Q4_0 (activations quantized
// per 32 values as llama.cpp's Q8_0) when k is a multiple of 256.
template <class T>
constexpr bool has_panels() {
#ifdef RSMEM_INT8
  return has_int8<T>() || std::is_same_v<T, Q8_0> || std::is_same_v<T, Q4_0>;
#else
  return false;
#endif
}

template <class T>
at::Tensor run(const at::Tensor& x, const at::Tensor& blocks, int64_t k, int64_t route) {
  const int64_t M = x.size(0), N = blocks.size(0);
  TORCH_CHECK_VALUE(route != 3 || has_int8<T>(), "route 3 (int8) has no kernel for this type here");
  TORCH_CHECK_VALUE(route != 4 || (has_panels<T>() && k % 256 == 0),
                    "route 4 (int8 panels) has no kernel for this type and k here");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (route < 0) {
    if (has_int8<T>()) {
      route = M <= int8_registers_max_m<T>() ? 3 : 4;
    } else if (has_panels<T>() && k % 256 == 0 && M >= kSmallPanelsMinM) {
      route = 4;
    } else {
      route = M < kTileMinM ? 0 : kLargeRoute;
    }
  }
#ifdef RSMEM_INT8
  if constexpr (has_panels<T>()) {
    if (route == 4) {
      i8::matmul_panels<T>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, k);
      return y;
    }
  }
  if constexpr (has_int8<T>()) {
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

template <class F>
auto by_type(int64_t qtype, const at::Tensor& blocks, int64_t k, F&& f) {
  switch (qtype) {
    case kQ8_0: check<Q8_0>(blocks, k, "Q8_0"); return f(Q8_0{});
    case kQ4_0: check<Q4_0>(blocks, k, "Q4_0"); return f(Q4_0{});
    case kQ4_K: check<Q4_K>(blocks, k, "Q4_K"); return f(Q4_K{});
    case kQ5_K: check<Q5_K>(blocks, k, "Q5_K"); return f(Q5_K{});
    case kQ6_K: check<Q6_K>(blocks, k, "Q6_K"); return f(Q6_K{});
    default: TORCH_CHECK_VALUE(false, "qtype ", qtype, " has no kernel (kernel types: Q8_0, Q4_0, Q4_K, Q5_K, Q6_K)");
  }
}

at::Tensor qmatmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t k, int64_t route) {
  TORCH_CHECK_VALUE(route >= -1 && route <= 4, "route must be -1 (by M), 0, 1, 2, 3 or 4");
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
