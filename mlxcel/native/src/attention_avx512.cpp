// Attention with AVX-512, one query row at a time: see AttnArgs in kernels.h; the row loop is
// attention_rows.h's, the vector work here.
#include <immintrin.h>

#include "attention_rows.h"
#include "kernels.h"
#include "math_avx512.h"

namespace mlxcel_native {
namespace {

inline __mmask16 tail(int n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// out[0, Dv) = sum_i w[i] * inv * v[kept[i]] with the sums held in NV registers (Dv <= 16 NV):
// each element adds its terms in key order, so cutting a head into slices of 128 changes no
// bits, and no store and reload per key (that chain, not the arithmetic, bounded a sum kept
// in memory).
template <int NV>
void weighted_sum_regs(const float* w, const int* kept, int n, float inv, const float* v,
                       int64_t v_ss, int Dv, float* out) {
  __m512 acc[NV];
  __mmask16 m[NV];
  for (int c = 0; c < NV; ++c) {
    acc[c] = _mm512_setzero_ps();
    m[c] = tail(Dv - 16 * c);
  }
  for (int i = 0; i < n; ++i) {
    const __m512 wi = _mm512_set1_ps(w[i] * inv);
    const float* vs = v + kept[i] * v_ss;
    for (int c = 0; c < NV; ++c)
      acc[c] = _mm512_fmadd_ps(wi, _mm512_maskz_loadu_ps(m[c], vs + 16 * c), acc[c]);
  }
  for (int c = 0; c < NV; ++c) _mm512_mask_storeu_ps(out + 16 * c, m[c], acc[c]);
}

using RegSum = void (*)(const float*, const int*, int, float, const float*, int64_t, int, float*);
constexpr int kMaxRegSums = 8;  // slices of 128 (8 of the 32 vector registers)
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

struct Avx512 {
  static constexpr int kLanes = 16;

  // One key's score: 16 lanes of partial sums (lane l adds the products of d = l, l + 16, ...
  // in order), folded by _mm512_reduce_add_ps (l with l + 8, then l + 4, l + 2, l + 1).
  static float score1(const float* qs, const float* ks, int D) {
    __m512 sum = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
      const __mmask16 m = tail(D - d);
      sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qs + d), _mm512_maskz_loadu_ps(m, ks + d),
                            sum);
    }
    return _mm512_reduce_add_ps(sum);
  }

  // 16 keys' scores from the keys transposed (kt: [D][16], key j in lane j), each sum grouped
  // exactly as score1 groups it, so a key gets the same bits either way and which path runs
  // (it depends on the query count) never shows in a result.
  static void scores_block(const float* qs, const float* kt, int D, float* out) {
    __m512 acc[16];
    for (int l = 0; l < 16; ++l) acc[l] = _mm512_setzero_ps();
    for (int d = 0; d < D; ++d)
      acc[d & 15] =
          _mm512_fmadd_ps(_mm512_set1_ps(qs[d]), _mm512_loadu_ps(kt + d * 16), acc[d & 15]);
    for (int l = 0; l < 8; ++l) acc[l] = _mm512_add_ps(acc[l + 8], acc[l]);
    for (int l = 0; l < 4; ++l) acc[l] = _mm512_add_ps(acc[l + 4], acc[l]);
    for (int l = 0; l < 2; ++l) acc[l] = _mm512_add_ps(acc[l], acc[l + 2]);
    _mm512_storeu_ps(out, _mm512_add_ps(acc[0], acc[1]));
  }

  // Lane-wise, then across lanes: a fixed order over the kept keys alone.
  static float exp_sum(float* scores, int n, float mx) {
    const __m512 vmax = _mm512_set1_ps(mx);
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      const __m512 e =
          exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores + i), vmax));
      const __m512 e_kept = _mm512_maskz_mov_ps(m, e);
      _mm512_mask_storeu_ps(scores + i, m, e_kept);
      total = _mm512_add_ps(total, e_kept);
    }
    return _mm512_reduce_add_ps(total);
  }

  static void weighted_sum(const float* w, const int* kept, int n, float inv, const float* v,
                           int64_t v_ss, int Dv, float* out) {
    for (int d0 = 0; d0 < Dv; d0 += 16 * kMaxRegSums) {
      const int width = Dv - d0 < 16 * kMaxRegSums ? Dv - d0 : 16 * kMaxRegSums;
      kRegSums[(width + 15) / 16](w, kept, n, inv, v + d0, v_ss, width, out + d0);
    }
  }
};

}  // namespace

void attention_avx512(const AttnArgs& a, int64_t r0, int64_t r1) {
  attend_rows<Avx512>(a, r0, r1);
}

}  // namespace mlxcel_native
