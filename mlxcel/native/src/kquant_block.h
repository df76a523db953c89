// GGUF's K-quant blocks decoded for the AVX2 and AVX-512 kernels' translation units (both have
// AVX2 and F16C); internal linkage in each, as tile_plan.h, so no copy is shared with code built
// without them. Each format is a trait (Q4kFormat, Q6kFormat) that the kernels are templated
// on: a block of 256 weights decodes to int8 codes q[256] and per 16 weights a float32 scale
// s[16] and, for formats with mins, an offset m[16]: weight i = q[i] * s[i / 16] + m[i / 16].
//
// llama.cpp's block_q6_K (ggml-common.h), 256 weights in 210 bytes: ql[128] (low 4 bits),
// qh[64] (high 2 bits), int8 scales[16] (one per 16 weights), float16 d; weight i =
// d * scales[i / 16] * (code_i - 32). Per half h of 128 weights (ql + 64h, qh + 32h), element
// l < 32 of each quarter: quarter 0 ql[l] & 15 with qh[l] bits 0-1, quarter 1 ql[l + 32] & 15
// with bits 2-3, quarter 2 ql[l] >> 4 with bits 4-5, quarter 3 ql[l + 32] >> 4 with bits 6-7.
#pragma once

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace mlxcel_native {
namespace {

// The block at `b` -> q[256] (code - 32 as int8, in weight order; with kCentred false the
// 6-bit code itself, 0..63) and s[16] (d * scale, float32: the product gguf-py's and
// llama.cpp's dequantisation form first).
template <bool kCentred = true>
inline void q6k_decode(const uint8_t* b, int8_t* q, float* s) {
  const uint16_t d_bits = uint16_t(b[208] | (b[209] << 8));
  const __m128i sc = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b + 192));
#if defined(__AVX512BW__)
  // The AVX-512 translation units: a half's 64 ql bytes in one register, its 32 qh bytes
  // twice (as is for quarters 0 and 2, shifted right by 2 for quarters 1 and 3), so each half
  // is two 64-byte results: weights 0-63 and 64-127.
  const __m512i low4 = _mm512_set1_epi8(0x0f);
  const __m512i bits45 = _mm512_set1_epi8(0x30);
  for (int h = 0; h < 2; ++h) {
    const __m512i l = _mm512_loadu_si512(b + 64 * h);
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    const __m512i hb2 =
        _mm512_inserti64x4(_mm512_castsi256_si512(hb), _mm256_srli_epi16(hb, 2), 1);
    __m512i lo = _mm512_or_si512(_mm512_and_si512(l, low4),
                                 _mm512_and_si512(_mm512_slli_epi16(hb2, 4), bits45));
    __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(l, 4), low4),
                                 _mm512_and_si512(hb2, bits45));
    if (kCentred) {
      lo = _mm512_sub_epi8(lo, _mm512_set1_epi8(32));
      hi = _mm512_sub_epi8(hi, _mm512_set1_epi8(32));
    }
    _mm512_storeu_si512(q + 128 * h, lo);
    _mm512_storeu_si512(q + 128 * h + 64, hi);
  }
  _mm512_storeu_ps(s, _mm512_mul_ps(_mm512_set1_ps(_cvtsh_ss(d_bits)),
                                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))));
#else
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  const __m256i bits45 = _mm256_set1_epi8(0x30);
  const __m256i bias = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 64 * h + 32));
    const __m256i hb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 128 + 32 * h));
    // Each quarter's two high bits moved to bits 4-5 of its byte (16-bit shifts, then a byte
    // mask: no bit crosses into the neighbouring byte's kept bits).
    const __m256i v[4] = {
        _mm256_or_si256(_mm256_and_si256(l0, low4),
                        _mm256_and_si256(_mm256_slli_epi16(hb, 4), bits45)),
        _mm256_or_si256(_mm256_and_si256(l1, low4),
                        _mm256_and_si256(_mm256_slli_epi16(hb, 2), bits45)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4),
                        _mm256_and_si256(hb, bits45)),
        _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                        _mm256_and_si256(_mm256_srli_epi16(hb, 2), bits45)),
    };
    for (int j = 0; j < 4; ++j)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 128 * h + 32 * j),
                          kCentred ? _mm256_sub_epi8(v[j], bias) : v[j]);
  }
  const __m256 d = _mm256_set1_ps(_cvtsh_ss(d_bits));
  _mm256_storeu_ps(s, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc))));
  _mm256_storeu_ps(
      s + 8, _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)))));
#endif
}

// llama.cpp's block_q4_K, 256 weights in 144 bytes: float16 d, float16 dmin, scales[12] (eight
// 6-bit scales and eight 6-bit mins, one pair per 32 weights, packed as get_scale_min_k4
// reads them), qs[128]; per 64 weights j, qs[32j..32j+32) hold weights 64j..64j+31 in their
// low nibbles and 64j+32..64j+63 in their high ones; weight = d * sc * q - dmin * mn.
// A Q4_K block's eight sub-block scales d * sc -> s[8] and offsets -(dmin * mn) -> m[8].
inline void q4k_scales(const uint8_t* b, float* s, float* m) {
  // The 12 scale bytes rearranged as llama.cpp's AVX kernels do (utmp): scales 0-7 in bytes
  // 0-7, mins 0-7 in bytes 8-15 (kquant_scales.h's q4k_scale_min, eight at once).
  uint32_t u[4];
  std::memcpy(u, b + 4, 12);
  constexpr uint32_t k6 = 0x3f3f3f3f, k4 = 0x0f0f0f0f, k2 = 0x03030303;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
  const uint32_t mins_lo = u[1] & k6;
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  u[2] = mins_lo;
  u[0] &= k6;
  const __m128i packed = _mm_loadu_si128(reinterpret_cast<const __m128i*>(u));
  const __m256 sc = _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(uint16_t(b[0] | (b[1] << 8)))),
                                  _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(packed)));
  // -(dmin * mn): the product rounded as llama.cpp rounds it, then negated (exact).
  const __m256 mn = _mm256_sub_ps(
      _mm256_setzero_ps(),
      _mm256_mul_ps(_mm256_set1_ps(_cvtsh_ss(uint16_t(b[2] | (b[3] << 8)))),
                    _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(packed, 8)))));
  _mm256_storeu_ps(s, sc);
  _mm256_storeu_ps(m, mn);
}

// The block at `b` -> q[256] (the nibbles, 0..15, in weight order), s[16] (d * sc) and m[16]
// (-(dmin * mn)), each sub-block's pair written twice (per 16 weights, as the kernels read);
// both products formed in float32 as llama.cpp and gguf-py form them.
inline void q4k_decode(const uint8_t* b, int8_t* q, float* s, float* m) {
  alignas(32) float s8[8], m8[8];
  q4k_scales(b, s8, m8);
  const __m256 sc = _mm256_load_ps(s8), mn = _mm256_load_ps(m8);
  // Each sub-block's pair written twice (per 16 weights).
  const __m256i lo = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  const __m256i hi = _mm256_setr_epi32(4, 4, 5, 5, 6, 6, 7, 7);
  _mm256_storeu_ps(s, _mm256_permutevar8x32_ps(sc, lo));
  _mm256_storeu_ps(s + 8, _mm256_permutevar8x32_ps(sc, hi));
  _mm256_storeu_ps(m, _mm256_permutevar8x32_ps(mn, lo));
  _mm256_storeu_ps(m + 8, _mm256_permutevar8x32_ps(mn, hi));
  const __m256i low4 = _mm256_set1_epi8(0x0f);
  for (int j = 0; j < 4; ++j) {
    const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b + 16 + 32 * j));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * j), _mm256_and_si256(v, low4));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + 64 * j + 32),
                        _mm256_and_si256(_mm256_srli_epi16(v, 4), low4));
  }
}

// The formats' traits. kBytes: a block's size; kMins: whether m[] is read (Q6_K's weights have
// no offset, so its kernels multiply where Q4_K's fuse a multiply-add); kSub: the inputs one
// scale covers (the int8 kernel's integer dot products run over that many); kOffset: what the
// raw codes are stored above zero (Q6_K's 32), which the int8 kernel takes off as
// kOffset * sum(xq). decode<kCentred>: q as code - kOffset (false: the raw code, unsigned).
struct Q6kFormat {
  static constexpr int kBytes = kQ6kBlockBytes;
  static constexpr bool kMins = false;
  static constexpr int kSub = 16;
  static constexpr int kOffset = 32;
  template <bool kCentred = true>
  static void decode(const uint8_t* b, int8_t* q, float* s, float*) {
    q6k_decode<kCentred>(b, q, s);
  }
};

struct Q4kFormat {
  static constexpr int kBytes = kQ4kBlockBytes;
  static constexpr bool kMins = true;
  static constexpr int kSub = 32;
  static constexpr int kOffset = 0;
  template <bool kCentred = true>
  static void decode(const uint8_t* b, int8_t* q, float* s, float* m) {
    q4k_decode(b, q, s, m);
  }
  // Per sub-block of 32 (8 each), for kernels that read the nibbles as stored.
  static void scales(const uint8_t* b, float* s, float* m) { q4k_scales(b, s, m); }
};

// Calls f.template operator()<Format>() for a.format.
template <class F>
inline void with_format(KQuant format, F&& f) {
  if (format == KQuant::q4_k) return f.template operator()<Q4kFormat>();
  f.template operator()<Q6kFormat>();
}

}  // namespace
}  // namespace mlxcel_native
