// Element-wise kernels with AVX2 (-mavx2 -mfma only): see kernels.h.
#include <immintrin.h>

#include "kernels.h"
#include "math_avx2.h"

namespace mlxcel_native {

void silu_mul_avx2(const float* gate, const float* x, float* out, int64_t i0, int64_t i1) {
  const __m256 one = _mm256_set1_ps(1.0f);
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t i = i0; i < i1; i += 8) {
    const __m256i m = tail8(i1 - i >= 8 ? 8 : int(i1 - i));
    const __m256 g = _mm256_maskload_ps(gate + i, m);
    // sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) <= 1: no
    // overflow either way.
    const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));
    const __m256 r = _mm256_div_ps(one, _mm256_add_ps(one, e));
    const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
    const __m256 sig = _mm256_blendv_ps(r, _mm256_mul_ps(r, e), neg);
    _mm256_maskstore_ps(out + i, m, _mm256_mul_ps(_mm256_mul_ps(g, sig), _mm256_maskload_ps(x + i, m)));
  }
}

}  // namespace mlxcel_native
