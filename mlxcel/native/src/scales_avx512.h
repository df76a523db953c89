// Scales and biases as float32, from their stored type. For the AVX-512 translation units only
// (it uses F16C); internal linkage in each, so no copy is shared with code built without it.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "scale_at.h"

namespace mlxcel_native {
namespace {

// `count` scales or biases from src[offset], widened to float32 into dst, 16 at a time.
template <ScaleType ST>
inline void widen(const void* src, long offset, int count, float* dst) {
  for (int i = 0; i < count; i += 16) {
    const __mmask16 m = count - i >= 16 ? __mmask16(0xffff) : __mmask16((1u << (count - i)) - 1);
    __m512 v;
    if constexpr (ST == ScaleType::f32) {
      v = _mm512_maskz_loadu_ps(m, static_cast<const float*>(src) + offset + i);
    } else {
      const __m256i h =
          _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src) + offset + i);
      if constexpr (ST == ScaleType::f16) {
        v = _mm512_cvtph_ps(h);
      } else {
        v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
      }
    }
    _mm512_mask_storeu_ps(dst + i, m, v);
  }
}

}  // namespace
}  // namespace mlxcel_native
