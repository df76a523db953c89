// Element-wise kernels with AVX-512: see kernels.h.
#include <immintrin.h>

#include "kernels.h"
#include "math_avx512.h"

namespace mlxcel_native {

void silu_mul_avx512(const float* gate, const float* x, float* out, int64_t i0, int64_t i1) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = i0; i < i1; i += 16) {
    const __mmask16 m = i1 - i >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << (i1 - i)) - 1);
    const __m512 g = _mm512_maskz_loadu_ps(m, gate + i);
    // sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, e = exp(-|g|) <= 1: no
    // overflow either way.
    const __m512 e = exp_nonpositive(_mm512_or_ps(g, sign));
    const __m512 r = _mm512_div_ps(one, _mm512_add_ps(one, e));
    const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
    const __m512 sig = _mm512_mask_mul_ps(r, neg, r, e);
    _mm512_mask_storeu_ps(out + i, m,
                          _mm512_mul_ps(_mm512_mul_ps(g, sig), _mm512_maskz_loadu_ps(m, x + i)));
  }
}

}  // namespace mlxcel_native
