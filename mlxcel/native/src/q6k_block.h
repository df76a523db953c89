// One Q6_K block decoded for the AVX2 and AVX-512 kernels' translation units (both have AVX2
// and F16C); internal linkage in each, as tile_plan.h, so no copy is shared with code built
// without them.
//
// llama.cpp's block_q6_K (ggml-common.h), 256 weights in 210 bytes: ql[128] (low 4 bits),
// qh[64] (high 2 bits), int8 scales[16] (one per 16 weights), float16 d; weight i =
// d * scales[i / 16] * (code_i - 32). Per half h of 128 weights (ql + 64h, qh + 32h), element
// l < 32 of each quarter: quarter 0 ql[l] & 15 with qh[l] bits 0-1, quarter 1 ql[l + 32] & 15
// with bits 2-3, quarter 2 ql[l] >> 4 with bits 4-5, quarter 3 ql[l + 32] >> 4 with bits 6-7.
#pragma once

#include <immintrin.h>

#include <cstdint>

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

}  // namespace
}  // namespace mlxcel_native
