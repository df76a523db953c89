// Attention with AVX2 (-mavx2 -mfma only), one query row at a time: see AttnArgs in kernels.h;
// the row loop is attention_rows.h's, the vector work here, as attention_avx512.cpp's at 8
// lanes.
#include <immintrin.h>

#include "attention_rows.h"
#include "kernels.h"
#include "math_avx2.h"

namespace mlxcel_native {
namespace {

// out[0, width) = sum_i w[i] * inv * v[kept[i]], the sums held in NV registers (width <= 8 NV):
// each element adds its terms in key order, so cutting a head into slices of 64 (8 of the 16
// registers) changes no bits.
template <int NV>
void weighted_sum_regs(const float* w, const int* kept, int n, float inv, const float* v,
                       int64_t v_ss, int width, float* out) {
  __m256 acc[NV];
  __m256i m[NV];
  for (int c = 0; c < NV; ++c) {
    acc[c] = _mm256_setzero_ps();
    m[c] = tail8(width - 8 * c);
  }
  for (int i = 0; i < n; ++i) {
    const __m256 wi = _mm256_set1_ps(w[i] * inv);
    const float* vs = v + kept[i] * v_ss;
    for (int c = 0; c < NV; ++c)
      acc[c] = _mm256_fmadd_ps(wi, _mm256_maskload_ps(vs + 8 * c, m[c]), acc[c]);
  }
  for (int c = 0; c < NV; ++c) _mm256_maskstore_ps(out + 8 * c, m[c], acc[c]);
}

using RegSum = void (*)(const float*, const int*, int, float, const float*, int64_t, int, float*);
constexpr int kMaxRegSums = 8;
constexpr RegSum kRegSums[kMaxRegSums + 1] = {
    nullptr,
    weighted_sum_regs<1>,
    weighted_sum_regs<2>,
    weighted_sum_regs<3>,
    weighted_sum_regs<4>,
    weighted_sum_regs<5>,
    weighted_sum_regs<6>,
    weighted_sum_regs<7>,
    weighted_sum_regs<8>,
};

struct Avx2 {
  static constexpr int kLanes = 8;

  // One key's score: 8 lanes of partial sums (lane l adds the products of d = l, l + 8, ...
  // in order), folded by hsum8 (l with l + 4, then l + 2, then l + 1).
  static float score1(const float* qs, const float* ks, int D) {
    __m256 sum = _mm256_setzero_ps();
    int d = 0;
    for (; d + 8 <= D; d += 8)
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(qs + d), _mm256_loadu_ps(ks + d), sum);
    if (d < D) {
      const __m256i m = tail8(D - d);
      sum = _mm256_fmadd_ps(_mm256_maskload_ps(qs + d, m), _mm256_maskload_ps(ks + d, m), sum);
    }
    return hsum8(sum);
  }

  // 8 keys' scores from the keys transposed (kt: [D][8], key j in lane j), each sum grouped
  // exactly as score1 groups it (same bits, whichever path the query count picks).
  static void scores_block(const float* qs, const float* kt, int D, float* out) {
    __m256 acc[8];
    for (int l = 0; l < 8; ++l) acc[l] = _mm256_setzero_ps();
    for (int d = 0; d < D; ++d)
      acc[d & 7] =
          _mm256_fmadd_ps(_mm256_set1_ps(qs[d]), _mm256_loadu_ps(kt + d * 8), acc[d & 7]);
    for (int l = 0; l < 4; ++l) acc[l] = _mm256_add_ps(acc[l], acc[l + 4]);
    for (int l = 0; l < 2; ++l) acc[l] = _mm256_add_ps(acc[l], acc[l + 2]);
    _mm256_storeu_ps(out, _mm256_add_ps(acc[0], acc[1]));
  }

  // Lane-wise, then across lanes: a fixed order over the kept keys alone.
  static float exp_sum(float* scores, int n, float mx) {
    const __m256 vmax = _mm256_set1_ps(mx);
    __m256 total = _mm256_setzero_ps();
    for (int j = 0; j < n; j += 8) {
      const __m256i m = tail8(n - j);
      const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_maskload_ps(scores + j, m), vmax));
      const __m256 e_kept = _mm256_and_ps(e, _mm256_castsi256_ps(m));
      _mm256_maskstore_ps(scores + j, m, e_kept);
      total = _mm256_add_ps(total, e_kept);
    }
    return hsum8(total);
  }

  static void weighted_sum(const float* w, const int* kept, int n, float inv, const float* v,
                           int64_t v_ss, int Dv, float* out) {
    for (int d0 = 0; d0 < Dv; d0 += 8 * kMaxRegSums) {
      const int width = Dv - d0 < 8 * kMaxRegSums ? Dv - d0 : 8 * kMaxRegSums;
      kRegSums[(width + 7) / 8](w, kept, n, inv, v + d0, v_ss, width, out + d0);
    }
  }
};

}  // namespace

void attention_avx2(const AttnArgs& a, int64_t r0, int64_t r1) {
  attend_rows<Avx2>(a, r0, r1);
}

}  // namespace mlxcel_native
