// rsmem's products with matrices held in ggml's block form: y[M, N] = x[M, K] @ W[N, K]^T, W as uint8
// rows of blocks. Registered as torch ops rsmem_native::qmatmul / dequantize (no pybind: loaded with
// torch.ops.load_library). Threaded with at::parallel_for over output rows (torch.set_num_threads).
//
// Routes (`route` -1 chooses by M):
//   0 "registers": each block of NR weight rows is dequantized into registers and multiplied with up to
//     four activation rows at a time (activations stay float32: the reference's values, summation order
//     aside). Used for M < kTileMinM.
//   1 "tiles": tiles of kTileRows weight rows are dequantized to float32 (in cache, per thread) and
//     multiplied with at::mm. Used for M >= kTileMinM.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <string>
#include <vector>

#include "blocks.h"

namespace rsmem {
namespace {

constexpr int64_t kTileMinM = 16;
constexpr int64_t kTileRows = 64;

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
  for (int64_t ib = 0; ib < nb; ++ib) {
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

template <class T, int NR>
void rows_all_m(const uint8_t* w, int64_t ldw, int64_t nb, const float* x, int64_t M, int64_t K, float* y,
                int64_t N) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) tile_dot<T, NR, 4>(w, ldw, nb, x + m * K, K, y + m * N, N);
  switch (M - m) {
    case 3: tile_dot<T, NR, 3>(w, ldw, nb, x + m * K, K, y + m * N, N); break;
    case 2: tile_dot<T, NR, 2>(w, ldw, nb, x + m * K, K, y + m * N, N); break;
    case 1: tile_dot<T, NR, 1>(w, ldw, nb, x + m * K, K, y + m * N, N); break;
    default: break;
  }
}

template <class T>
void matmul_registers(const float* x, const uint8_t* w, float* y, int64_t M, int64_t N, int64_t K) {
  constexpr int NR = 4;
  const int64_t nb = K / T::BS, ldw = nb * T::TS;
  const int64_t groups = (N + NR - 1) / NR;
  // at least ~64 KB of weights per task, so small matrices are not split into tiny pieces
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / std::max<int64_t>(1, ldw * NR));
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

template <class T>
at::Tensor run(const at::Tensor& x, const at::Tensor& blocks, int64_t k, int64_t route) {
  const int64_t M = x.size(0), N = blocks.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (route < 0) route = M >= kTileMinM ? 1 : 0;
  if (route == 1) {
    matmul_tiles<T>(x, blocks.data_ptr<uint8_t>(), y, N, k);
  } else {
    matmul_registers<T>(x.data_ptr<float>(), blocks.data_ptr<uint8_t>(), y.data_ptr<float>(), M, N, k);
  }
  return y;
}

void check(const at::Tensor& blocks, int64_t qtype, int64_t k, int64_t bs, int64_t ts) {
  TORCH_CHECK(blocks.scalar_type() == at::kByte && blocks.dim() == 2 && blocks.is_contiguous(),
              "blocks must be a contiguous 2-D uint8 tensor");
  TORCH_CHECK(k > 0 && k % bs == 0, "k=", k, " is not a multiple of the block size ", bs, " of type ", qtype);
  TORCH_CHECK(blocks.size(1) == k / bs * ts, "blocks have row_bytes=", blocks.size(1), ", type ", qtype,
              " needs ", k / bs * ts);
}

template <class F>
auto by_type(int64_t qtype, const at::Tensor& blocks, int64_t k, F&& f) {
  switch (qtype) {
    case kQ8_0: check(blocks, qtype, k, Q8_0::BS, Q8_0::TS); return f(Q8_0{});
    case kQ4_0: check(blocks, qtype, k, Q4_0::BS, Q4_0::TS); return f(Q4_0{});
    case kQ4_K: check(blocks, qtype, k, Q4_K::BS, Q4_K::TS); return f(Q4_K{});
    case kQ5_K: check(blocks, qtype, k, Q5_K::BS, Q5_K::TS); return f(Q5_K{});
    case kQ6_K: check(blocks, qtype, k, Q6_K::BS, Q6_K::TS); return f(Q6_K{});
    default: TORCH_CHECK(false, "qtype ", qtype, " has no kernel");
  }
}

at::Tensor qmatmul(const at::Tensor& x_in, const at::Tensor& blocks, int64_t qtype, int64_t k, int64_t route) {
  TORCH_CHECK(x_in.scalar_type() == at::kFloat && x_in.dim() == 2 && x_in.size(1) == k,
              "x must be float32 [M, k]");
  const at::Tensor x = x_in.contiguous();
  return by_type(qtype, blocks, k, [&](auto t) { return run<decltype(t)>(x, blocks, k, route); });
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
#ifdef RSMEM_AVX512
  return "avx512";
#else
  return "portable";
#endif
}

}  // namespace
}  // namespace rsmem

TORCH_LIBRARY(rsmem_native, m) {
  m.def("qmatmul(Tensor x, Tensor blocks, int qtype, int k, int route=-1) -> Tensor", &rsmem::qmatmul);
  m.def("dequantize(Tensor blocks, int qtype, int k) -> Tensor", &rsmem::dequantize);
  m.def("isa() -> str", &rsmem::isa);
}
