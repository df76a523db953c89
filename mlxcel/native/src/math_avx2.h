// Vector helpers for the AVX2 translation units only; internal linkage in each (as
// math_avx512.h), so no copy is shared with code built for another instruction set.
#pragma once

#include <immintrin.h>

namespace mlxcel_native {
namespace {

// Lane i set (all ones) for i < n: the mask _mm256_maskload_ps / _mm256_maskstore_ps take.
inline __m256i tail8(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The sum of 8 lanes, folded in a fixed order: lane l with l + 4, then l + 2, then l + 1
// (attention's 8-key scores fold their sums in exactly this order; see attention_avx2.cpp).
inline float hsum8(__m256 v) {
  const __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 b = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(b, _mm_movehdup_ps(b)));
}

// exp(x) for x <= 0 (scores minus their max), as math_avx512.h's: x = n ln2 + r,
// |r| <= ln2 / 2, a degree-7 Taylor polynomial in r, scaled by 2^n built in the exponent bits.
// Below -87.3 (2^n would be subnormal) the result is 0, where the true value is < 1.2e-38.
inline __m256 exp_nonpositive(__m256 x) {
  const __m256 keep = _mm256_cmp_ps(x, _mm256_set1_ps(-87.3f), _CMP_GE_OQ);
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.3f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.0f / 5040);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_and_ps(_mm256_mul_ps(p, _mm256_castsi256_ps(e)), keep);
}

}  // namespace
}  // namespace mlxcel_native
