// Route 3 "int8" for Q8_0 and Q4_0 weights (few rows, k a multiple of 256): activations quantized per 32
// values as llama.cpp's Q8_0 does for these weights (int8.h's quantize_rows_per32: one scale d32 per 32
// values), and integer dot products in registers, as int8.h does for the K-quants.
//
// A zmm holds 64 weight values, two blocks, as unsigned bytes u = w + c: Q8_0's int8 w plus c = 128 (the
// sign bit flipped), Q4_0's nibbles q = (q - 8) + 8 (c = 8). vpdpbusd multiplies them with the signed
// activations, 4 to an int32 lane: sum u a = sum w a + c sum a, so each lane starts at -c times the sum of
// its 4 activations (vpdpbusd of c with them, once per activation row and 64 values, whatever the number
// of weight rows) and is then the exact integer sum w a of its 4 values (small: a lane's float32 product
// with the scales rounds as little as the sum would). Q4_0's
// nibbles come as [low nibbles of both blocks, high nibbles of both], so its activations are stored in
// that order (quantize_rows_per32's q4_order) and its int32 lanes alternate between the blocks every 4.
// Each block's sum, times the weights' and the activations' scales, is summed in float32.
#pragma once

#include "int8.h"

#ifdef RSMEM_INT8

namespace rsmem {
namespace i8 {

// Lane l of pair p belongs to block 2p + b(l) of the eight (Q8_0: b = l / 8; Q4_0: b = (l / 4) % 2).
struct PairIdx {
  alignas(64) int32_t q8[4][16];
  alignas(64) int32_t q4[4][16];
  constexpr PairIdx() : q8(), q4() {
    for (int p = 0; p < 4; ++p)
      for (int l = 0; l < 16; ++l) {
        q8[p][l] = 2 * p + l / 8;
        q4[p][l] = 2 * p + (l / 4) % 2;
      }
  }
};
alignas(64) inline constexpr PairIdx kPairIdx{};

template <class T>
struct Small;

template <>
struct Small<Q8_0> {
  static constexpr char kC = static_cast<char>(128);
  static RSMEM_INLINE const int32_t* idx(int p) { return kPairIdx.q8[p]; }
  // blocks 2p and 2p + 1 from `blk` (the first), plus 128
  static RSMEM_INLINE __m512i pair(const uint8_t* blk) {
    const __m256i b0 = _mm256_loadu_si256((const __m256i*)(blk + 2));
    const __m256i b1 = _mm256_loadu_si256((const __m256i*)(blk + Q8_0::TS + 2));
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b0), b1, 1);
    return _mm512_xor_si512(z, _mm512_set1_epi8(static_cast<char>(0x80)));
  }
};

template <>
struct Small<Q4_0> {
  static constexpr char kC = 8;
  static RSMEM_INLINE const int32_t* idx(int p) { return kPairIdx.q4[p]; }
  // the low nibbles of both blocks' 16 bytes, then the high ones
  static RSMEM_INLINE __m512i pair(const uint8_t* blk) {
    const __m128i b0 = _mm_loadu_si128((const __m128i*)(blk + 2));
    const __m128i b1 = _mm_loadu_si128((const __m128i*)(blk + Q4_0::TS + 2));
    const __m256i b = _mm256_inserti128_si256(_mm256_castsi128_si256(b0), b1, 1);
    const __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(b), _mm256_srli_epi16(b, 4), 1);
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
  }
};

// The eight f16 scales of eight consecutive blocks (stride TS bytes) as float32: one gather of 32-bit
// words, their low halves (the scales) narrowed to 16 bits (eight 2-byte stores read back as one vector
// stalled store forwarding). The last word read ends 2 bytes into the eighth block's values.
template <class T>
RSMEM_INLINE __m256 block_scales8(const uint8_t* blk) {
  const __m256i at = _mm256_setr_epi32(0, T::TS, 2 * T::TS, 3 * T::TS, 4 * T::TS, 5 * T::TS, 6 * T::TS, 7 * T::TS);
  const __m256i words = _mm256_i32gather_epi32((const int*)blk, at, 1);
  return _mm256_cvtph_ps(_mm256_cvtepi32_epi16(words));
}

// y[m * ldy + r] for NR weight rows (stride ldw) and MR activation rows (stride lda ABlocks, per 32 values),
// nb blocks of 256 values each: the same integers as route 4's panels, summed in another order.
template <class T, int NR, int MR>
inline void small_tile(const uint8_t* w, int64_t ldw, int64_t nb, const ABlock* a, int64_t lda, float* y,
                       int64_t ldy, int64_t prefetch_rows) {
  using S = Small<T>;
  constexpr int64_t kBytes = 256 / T::BS * T::TS;  // bytes of 256 values
  __m512 acc[NR][MR];
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) acc[r][m] = _mm512_setzero_ps();
  const uint8_t* pf = w + prefetch_rows * ldw;
  for (int64_t ib = 0; ib < nb; ++ib) {
    if (prefetch_rows)
      for (int off = 0; off < NR * kBytes; off += 64)
        _mm_prefetch((const char*)(pf + ib * NR * kBytes + off), _MM_HINT_T0);
    // each (weight row, activation row)'s scales of the 8 blocks, dw * d32
    __m512 s8[NR][MR];
#pragma GCC unroll 16
    for (int r = 0; r < NR; ++r) {
      const __m256 dw = block_scales8<T>(w + r * ldw + ib * kBytes);
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m)
        s8[r][m] = _mm512_castps256_ps512(_mm256_mul_ps(dw, _mm256_load_ps(a[m * lda + ib].d32)));
    }
#pragma GCC unroll 4
    for (int p = 0; p < 4; ++p) {
      const __m512i idx = _mm512_load_si512(S::idx(p));
      __m512i xv[MR], start[MR];
#pragma GCC unroll 16
      for (int m = 0; m < MR; ++m) {
        xv[m] = _mm512_load_si512((const void*)(a[m * lda + ib].q + 64 * p));
        const __m512i ca = _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(S::kC), xv[m]);
        start[m] = _mm512_sub_epi32(_mm512_setzero_si512(), ca);
      }
#pragma GCC unroll 16
      for (int r = 0; r < NR; ++r) {
        const __m512i u = S::pair(w + r * ldw + ib * kBytes + 2 * p * T::TS);
#pragma GCC unroll 16
        for (int m = 0; m < MR; ++m) {
          const __m512i isum = _mm512_dpbusd_epi32(start[m], u, xv[m]);
          const __m512 sc = _mm512_permutexvar_ps(idx, s8[r][m]);
          acc[r][m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), sc, acc[r][m]);
        }
      }
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < NR; ++r)
#pragma GCC unroll 16
    for (int m = 0; m < MR; ++m) y[m * ldy + r] = _mm512_reduce_add_ps(acc[r][m]);
}

}  // namespace i8
}  // namespace rsmem
#endif
