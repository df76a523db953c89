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
// MORE: start from the sums in out (a row's values taken a block at a time).
template <int NV, bool MORE = false>
void weighted_sum_regs(const float* w, const int* kept, int n, float inv, const float* v,
                       int64_t v_ss, int width, float* out) {
  __m256 acc[NV];
  __m256i m[NV];
  for (int c = 0; c < NV; ++c) {
    m[c] = tail8(width - 8 * c);
    acc[c] = MORE ? _mm256_maskload_ps(out + 8 * c, m[c]) : _mm256_setzero_ps();
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
template <bool MORE>
constexpr RegSum kRegSums[kMaxRegSums + 1] = {
    nullptr,
    weighted_sum_regs<1, MORE>,
    weighted_sum_regs<2, MORE>,
    weighted_sum_regs<3, MORE>,
    weighted_sum_regs<4, MORE>,
    weighted_sum_regs<5, MORE>,
    weighted_sum_regs<6, MORE>,
    weighted_sum_regs<7, MORE>,
    weighted_sum_regs<8, MORE>,
};

// R rows of weighted_sum_regs over one slice of NV registers (R * NV <= 8 accumulators):
// each value is loaded once for all R rows; each row's sums are weighted_sum_regs' own.
template <int R, int NV>
void weighted_slice(const float* w, int64_t w_stride, const int* kept, int n, const float* inv,
                    const float* v, int64_t v_ss, int width, float* out, int64_t out_stride) {
  __m256 acc[R][NV];
  __m256i m[NV];
  for (int c = 0; c < NV; ++c) {
    m[c] = tail8(width - 8 * c);
    for (int j = 0; j < R; ++j) acc[j][c] = _mm256_setzero_ps();
  }
  for (int i = 0; i < n; ++i) {
    const float* vs = v + kept[i] * v_ss;
    __m256 wi[R];
    for (int j = 0; j < R; ++j) wi[j] = _mm256_set1_ps(w[j * w_stride + i] * inv[j]);
    for (int c = 0; c < NV; ++c) {
      const __m256 vc = _mm256_maskload_ps(vs + 8 * c, m[c]);
      for (int j = 0; j < R; ++j) acc[j][c] = _mm256_fmadd_ps(wi[j], vc, acc[j][c]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < NV; ++c) _mm256_maskstore_ps(out + j * out_stride + 8 * c, m[c], acc[j][c]);
}

struct Avx2 {
  static constexpr int kLanes = 8;
  static constexpr int kGroup = 2;
  static constexpr int kScoreRows = 2;  // rows scores_block_rows takes at once

  // R heads' scores of keys 0..n-1, each key loaded once; each score is score1's.
  template <int R>
  static void scores_rows(const float* qs, int D, const float* k, int64_t k_ss, int n,
                          float* out, int64_t out_stride) {
    for (int s = 0; s < n; ++s) {
      const float* ks = k + s * k_ss;
      __m256 sum[R];
      for (int j = 0; j < R; ++j) sum[j] = _mm256_setzero_ps();
      int d = 0;
      for (; d + 8 <= D; d += 8) {
        const __m256 kv = _mm256_loadu_ps(ks + d);
        for (int j = 0; j < R; ++j)
          sum[j] = _mm256_fmadd_ps(_mm256_loadu_ps(qs + j * D + d), kv, sum[j]);
      }
      if (d < D) {
        const __m256i m = tail8(D - d);
        const __m256 kv = _mm256_maskload_ps(ks + d, m);
        for (int j = 0; j < R; ++j)
          sum[j] = _mm256_fmadd_ps(_mm256_maskload_ps(qs + j * D + d, m), kv, sum[j]);
      }
      for (int j = 0; j < R; ++j) out[j * out_stride + s] = hsum8(sum[j]);
    }
  }

  // R rows of weighted_sum, in slices of 32 (elements are independent: no bits change).
  template <int R>
  static void weighted_sums(const float* w, int64_t w_stride, const int* kept, int n,
                            const float* inv, const float* v, int64_t v_ss, int Dv, float* out,
                            int64_t out_stride) {
    for (int d0 = 0; d0 < Dv; d0 += 32) {
      const int width = Dv - d0 < 32 ? Dv - d0 : 32;
      const float* vd = v + d0;
      float* od = out + d0;
      switch ((width + 7) / 8) {
        case 1: weighted_slice<R, 1>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
        case 2: weighted_slice<R, 2>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
        case 3: weighted_slice<R, 3>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
        default: weighted_slice<R, 4>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
      }
    }
  }

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

  // 8 keys' scores from the keys transposed (kt: [D][8], key j in lane j) for R rows
  // (rows[j]: row j's query at qs + rows[j] * D, its 8 scores to out + rows[j] * out_stride),
  // each block of keys loaded once for all of them, each key's sum grouped as score1's
  // (hsum8's folding): ((P_0 + P_4) + (P_2 + P_6)) + ((P_1 + P_5) + (P_3 + P_7)), one
  // partial at a time.
  template <int R>
  static void scores_block_rows(const float* qs, const int* rows, const float* kt, int D,
                                float* out, int64_t out_stride) {
    const float* q[R];
    for (int j = 0; j < R; ++j) q[j] = qs + int64_t(rows[j]) * D;
    const auto partial = [&](int l, __m256* p) {
      for (int j = 0; j < R; ++j) p[j] = _mm256_setzero_ps();
      for (int d = l; d < D; d += 8) {
        const __m256 kv = _mm256_loadu_ps(kt + d * 8);
        for (int j = 0; j < R; ++j) p[j] = _mm256_fmadd_ps(_mm256_set1_ps(q[j][d]), kv, p[j]);
      }
    };
    // A_l = P_l + P_{l+4} (l < 4)
    const auto pair4 = [&](int l, __m256* a) {
      __m256 lo[R], hi[R];
      partial(l, lo);
      partial(l + 4, hi);
      for (int j = 0; j < R; ++j) a[j] = _mm256_add_ps(lo[j], hi[j]);
    };
    // B_l = A_l + A_{l+2} (l < 2)
    const auto pair2 = [&](int l, __m256* b) {
      __m256 lo[R], hi[R];
      pair4(l, lo);
      pair4(l + 2, hi);
      for (int j = 0; j < R; ++j) b[j] = _mm256_add_ps(lo[j], hi[j]);
    };
    __m256 b0[R], b1[R];
    pair2(0, b0);
    pair2(1, b1);
    for (int j = 0; j < R; ++j)
      _mm256_storeu_ps(out + int64_t(rows[j]) * out_stride, _mm256_add_ps(b0[j], b1[j]));
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

  template <bool MORE = false>
  static void weighted_sum(const float* w, const int* kept, int n, float inv, const float* v,
                           int64_t v_ss, int Dv, float* out) {
    for (int d0 = 0; d0 < Dv; d0 += 8 * kMaxRegSums) {
      const int width = Dv - d0 < 8 * kMaxRegSums ? Dv - d0 : 8 * kMaxRegSums;
      kRegSums<MORE>[(width + 7) / 8](w, kept, n, inv, v + d0, v_ss, width, out + d0);
    }
  }

  static void weighted_sum_more(const float* w, const int* kept, int n, float inv,
                                const float* v, int64_t v_ss, int Dv, float* out) {
    weighted_sum<true>(w, kept, n, inv, v, v_ss, Dv, out);
  }
};

}  // namespace

void attention_avx2(const AttnArgs& a, int64_t r0, int64_t r1) {
  attend<Avx2>(a, r0, r1);
}

}  // namespace mlxcel_native
