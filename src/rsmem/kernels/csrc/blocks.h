// ggml's block layouts (ggml-common.h) decoded to float32: a portable scalar decoder per type (exactly
// gguf.quants.dequantize's operations) and, where AVX-512 is compiled in, a decoder of 32 values at a time
// into two zmm registers. A block is `BS` values in `TS` bytes; `Steps` = BS / 32.
#pragma once

#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || defined(__AVX2__) || defined(__F16C__)
#include <immintrin.h>
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__) && \
    defined(__F16C__)
#define RSMEM_AVX512 1
#endif

namespace rsmem {

enum QType : int64_t { kQ4_0 = 2, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14 };

// The least weight bytes a thread's share of a few-row product (routes 0 and 3) gets: a matrix under twice
// this runs on one thread. Beside busy processes, with threads that sleep between products, waking a second
// thread costs more than it saves on a matrix of a few MiB or less; a large head gains from it.
constexpr int64_t kTaskBytes = 1 << 20;

inline float f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#ifdef __F16C__
  return _cvtsh_ss(h);  // the same value as the portable conversion, in one instruction
#else
  return c10::detail::fp16_ieee_to_fp32_value(h);
#endif
}

// The eight 6-bit scales and mins of a Q4_K / Q5_K block (ggml's get_scale_min_k4).
inline void scale_min_k4(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0xF) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

// Per-block scales, decoded once per block: `a[j]` multiplies the values of step j's sub-blocks and
// `b[j]` is subtracted (K-quants with mins), as gguf computes them.
struct Scales {
  float a[16];
  float b[8];
};

struct Q8_0 {
  static constexpr int BS = 32, TS = 34;
  static void scales(const uint8_t* blk, Scales& s) { s.a[0] = f16(blk); }
  static void scalar(const uint8_t* blk, float* y) {
    const float d = f16(blk);
    for (int i = 0; i < 32; ++i) y[i] = d * static_cast<float>(static_cast<int8_t>(blk[2 + i]));
  }
};

struct Q4_0 {
  static constexpr int BS = 32, TS = 18;
  static void scales(const uint8_t* blk, Scales& s) { s.a[0] = f16(blk); }
  static void scalar(const uint8_t* blk, float* y) {
    const float d = f16(blk);
    for (int i = 0; i < 16; ++i) {
      y[i] = d * static_cast<float>((blk[2 + i] & 0xF) - 8);
      y[i + 16] = d * static_cast<float>((blk[2 + i] >> 4) - 8);
    }
  }
};

struct Q4_K {
  static constexpr int BS = 256, TS = 144;
  static void scales(const uint8_t* blk, Scales& s) {
#ifdef RSMEM_AVX512
    // the eight scales then the eight mins as 16 bytes (ggml's get_scale_min_k4 on 32-bit words), times
    // d and dmin: the same products as the scalar code
    uint32_t u[3], v[4];
    std::memcpy(u, blk + 4, 12);
    v[0] = u[0] & 0x3f3f3f3f;
    v[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);
    v[2] = u[1] & 0x3f3f3f3f;
    v[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)v)));
    const __m512 dd = _mm512_insertf32x8(_mm512_set1_ps(f16(blk)), _mm256_set1_ps(f16(blk + 2)), 1);
    const __m512 r = _mm512_mul_ps(q, dd);
    _mm256_storeu_ps(s.a, _mm512_castps512_ps256(r));
    _mm256_storeu_ps(s.b, _mm512_extractf32x8_ps(r, 1));
    return;
#endif
    uint8_t sc[8], mn[8];
    scale_min_k4(blk + 4, sc, mn);
    const float d = f16(blk), dmin = f16(blk + 2);
    for (int j = 0; j < 8; ++j) {
      s.a[j] = d * static_cast<float>(sc[j]);
      s.b[j] = dmin * static_cast<float>(mn[j]);
    }
  }
  static void scalar(const uint8_t* blk, float* y) {
    Scales s;
    scales(blk, s);
    const uint8_t* q = blk + 16;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        y[64 * c + l] = s.a[2 * c] * static_cast<float>(q[32 * c + l] & 0xF) - s.b[2 * c];
        y[64 * c + 32 + l] = s.a[2 * c + 1] * static_cast<float>(q[32 * c + l] >> 4) - s.b[2 * c + 1];
      }
  }
};

struct Q5_K {
  static constexpr int BS = 256, TS = 176;
  static void scales(const uint8_t* blk, Scales& s) { Q4_K::scales(blk, s); }
  static void scalar(const uint8_t* blk, float* y) {
    Scales s;
    scales(blk, s);
    const uint8_t* qh = blk + 16;
    const uint8_t* q = blk + 48;
    for (int c = 0; c < 4; ++c)
      for (int l = 0; l < 32; ++l) {
        const int lo = (q[32 * c + l] & 0xF) | (((qh[l] >> (2 * c)) & 1) << 4);
        const int hi = (q[32 * c + l] >> 4) | (((qh[l] >> (2 * c + 1)) & 1) << 4);
        y[64 * c + l] = s.a[2 * c] * static_cast<float>(lo) - s.b[2 * c];
        y[64 * c + 32 + l] = s.a[2 * c + 1] * static_cast<float>(hi) - s.b[2 * c + 1];
      }
  }
};

struct Q6_K {
  static constexpr int BS = 256, TS = 210;
  static void scales(const uint8_t* blk, Scales& s) {
    const float d = f16(blk + 208);
#ifdef RSMEM_AVX512
    const __m128i sc = _mm_loadu_si128((const __m128i*)(blk + 192));
    _mm512_storeu_ps(s.a, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
    return;
#endif
    for (int j = 0; j < 16; ++j) s.a[j] = d * static_cast<float>(static_cast<int8_t>(blk[192 + j]));
  }
  static void scalar(const uint8_t* blk, float* y) {
    Scales s;
    scales(blk, s);
    for (int n = 0; n < 2; ++n) {
      const uint8_t* ql = blk + 64 * n;
      const uint8_t* qh = blk + 128 + 32 * n;
      float* yn = y + 128 * n;
      for (int l = 0; l < 32; ++l) {
        const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
        const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
        const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
        const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
        const int is = 8 * n + l / 16;
        yn[l] = s.a[is] * static_cast<float>(q1);
        yn[l + 32] = s.a[is + 2] * static_cast<float>(q2);
        yn[l + 64] = s.a[is + 4] * static_cast<float>(q3);
        yn[l + 96] = s.a[is + 6] * static_cast<float>(q4);
      }
    }
  }
};

#ifdef RSMEM_AVX512
// Values 32 j .. 32 j + 31 of a block as two zmm registers (`w0`: the first 16), from its decoded scales.
template <class T>
struct Step;

inline __m512 u8_to_ps(__m128i v) { return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v)); }

template <>
struct Step<Q8_0> {
  static inline void get(const uint8_t* blk, const Scales& s, int, __m512& w0, __m512& w1) {
    const __m512 d = _mm512_set1_ps(s.a[0]);
    w0 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)))));
    w1 = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(blk + 18)))));
  }
};

inline __m512 iota16() { return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15); }

// 4-bit values through a table of their 16 dequantized values (vpermps reads an index's low 4 bits, so a
// byte widened to 32 bits indexes its low nibble, and shifted right by 4 its high one): one permute a
// value instead of convert and scale, and the table holds the reference's own products.
template <>
struct Step<Q4_0> {
  static inline void get(const uint8_t* blk, const Scales& s, int, __m512& w0, __m512& w1) {
    const __m512 table = _mm512_mul_ps(_mm512_set1_ps(s.a[0]), _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0f)));
    const __m512i z = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(blk + 2)));
    w0 = _mm512_permutexvar_ps(z, table);
    w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(z, 4), table);
  }
};

// 32 nibbles of Q4_K / Q5_K step j: the low nibbles of 32 bytes for even j, the high ones for odd j.
inline __m256i k4_nibbles(const uint8_t* qs, int j) {
  const __m256i b = _mm256_loadu_si256((const __m256i*)(qs + 32 * (j >> 1)));
  const __m256i m4 = _mm256_set1_epi8(0xF);
  return (j & 1) ? _mm256_and_si256(_mm256_srli_epi16(b, 4), m4) : _mm256_and_si256(b, m4);
}

inline void k_min_values(__m256i q, const Scales& s, int j, __m512& w0, __m512& w1) {
  const __m512 a = _mm512_set1_ps(s.a[j]), nb = _mm512_set1_ps(-s.b[j]);
  w0 = _mm512_fmadd_ps(u8_to_ps(_mm256_castsi256_si128(q)), a, nb);
  w1 = _mm512_fmadd_ps(u8_to_ps(_mm256_extracti128_si256(q, 1)), a, nb);
}

template <>
struct Step<Q4_K> {
  static inline void get(const uint8_t* blk, const Scales& s, int j, __m512& w0, __m512& w1) {
    // table[v] = a * v - b: fma's single rounding of the exact product minus b, as the reference
    const __m512 table = _mm512_fmadd_ps(iota16(), _mm512_set1_ps(s.a[j]), _mm512_set1_ps(-s.b[j]));
    const uint8_t* q = blk + 16 + 32 * (j >> 1);
    __m512i z0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    __m512i z1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(q + 16)));
    if (j & 1) {
      z0 = _mm512_srli_epi32(z0, 4);
      z1 = _mm512_srli_epi32(z1, 4);
    }
    w0 = _mm512_permutexvar_ps(z0, table);
    w1 = _mm512_permutexvar_ps(z1, table);
  }
};

template <>
struct Step<Q5_K> {
  static inline void get(const uint8_t* blk, const Scales& s, int j, __m512& w0, __m512& w1) {
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 16));
    const __m256i bit = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(1));
    const __m256i q = _mm256_or_si256(k4_nibbles(blk + 48, j), _mm256_slli_epi16(bit, 4));
    k_min_values(q, s, j, w0, w1);
  }
};

template <>
struct Step<Q6_K> {
  static inline void get(const uint8_t* blk, const Scales& s, int j, __m512& w0, __m512& w1) {
    const int n = j >> 2, t = j & 3;
    const __m256i b = _mm256_loadu_si256((const __m256i*)(blk + 64 * n + 32 * (t & 1)));
    const __m256i m4 = _mm256_set1_epi8(0xF);
    const __m256i nib = (t & 2) ? _mm256_and_si256(_mm256_srli_epi16(b, 4), m4) : _mm256_and_si256(b, m4);
    const __m256i qh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * n));
    const __m256i hi = _mm256_and_si256(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * t)), _mm256_set1_epi8(3));
    // q - 32 in -32..31 as int8 (one byte-wide subtraction), then sign-extended
    const __m256i q = _mm256_sub_epi8(_mm256_or_si256(nib, _mm256_slli_epi16(hi, 4)), _mm256_set1_epi8(32));
    const __m512i q0 = _mm512_cvtepi8_epi32(_mm256_castsi256_si128(q));
    const __m512i q1 = _mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1));
    w0 = _mm512_mul_ps(_mm512_set1_ps(s.a[2 * j]), _mm512_cvtepi32_ps(q0));
    w1 = _mm512_mul_ps(_mm512_set1_ps(s.a[2 * j + 1]), _mm512_cvtepi32_ps(q1));
  }
};
#endif

}  // namespace rsmem
