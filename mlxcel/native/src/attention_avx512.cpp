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
// MORE: start from the sums in out (a row's values taken a block at a time).
template <int NV, bool MORE = false>
void weighted_sum_regs(const float* w, const int* kept, int n, float inv, const float* v,
                       int64_t v_ss, int Dv, float* out) {
  __m512 acc[NV];
  __mmask16 m[NV];
  for (int c = 0; c < NV; ++c) {
    m[c] = tail(Dv - 16 * c);
    acc[c] = MORE ? _mm512_maskz_loadu_ps(m[c], out + 16 * c) : _mm512_setzero_ps();
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

// R rows of weighted_sum_regs over one slice of NV registers (R * NV <= 16 accumulators):
// each value is loaded once for all R rows; each row's sums are weighted_sum_regs' own.
template <int R, int NV>
void weighted_slice(const float* w, int64_t w_stride, const int* kept, int n, const float* inv,
                    const float* v, int64_t v_ss, int width, float* out, int64_t out_stride) {
  __m512 acc[R][NV];
  __mmask16 m[NV];
  for (int c = 0; c < NV; ++c) {
    m[c] = tail(width - 16 * c);
    for (int j = 0; j < R; ++j) acc[j][c] = _mm512_setzero_ps();
  }
  for (int i = 0; i < n; ++i) {
    const float* vs = v + kept[i] * v_ss;
    __m512 wi[R];
    for (int j = 0; j < R; ++j) wi[j] = _mm512_set1_ps(w[j * w_stride + i] * inv[j]);
    for (int c = 0; c < NV; ++c) {
      const __m512 vc = _mm512_maskz_loadu_ps(m[c], vs + 16 * c);
      for (int j = 0; j < R; ++j) acc[j][c] = _mm512_fmadd_ps(wi[j], vc, acc[j][c]);
    }
  }
  for (int j = 0; j < R; ++j)
    for (int c = 0; c < NV; ++c) _mm512_mask_storeu_ps(out + j * out_stride + 16 * c, m[c], acc[j][c]);
}

struct Avx512 {
  static constexpr int kLanes = 16;
  static constexpr int kGroup = 4;
  static constexpr int kScoreRows = 4;  // rows scores_block_rows takes at once

  // R heads' scores of keys 0..n-1, each key loaded once; each score is score1's.
  template <int R>
  static void scores_rows(const float* qs, int D, const float* k, int64_t k_ss, int n,
                          float* out, int64_t out_stride) {
    for (int s = 0; s < n; ++s) {
      const float* ks = k + s * k_ss;
      __m512 sum[R];
      for (int j = 0; j < R; ++j) sum[j] = _mm512_setzero_ps();
      for (int d = 0; d < D; d += 16) {
        const __mmask16 m = tail(D - d);
        const __m512 kv = _mm512_maskz_loadu_ps(m, ks + d);
        for (int j = 0; j < R; ++j)
          sum[j] = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qs + j * D + d), kv, sum[j]);
      }
      for (int j = 0; j < R; ++j) out[j * out_stride + s] = _mm512_reduce_add_ps(sum[j]);
    }
  }

  // R rows of weighted_sum, in slices of 64 (elements are independent: no bits change).
  template <int R>
  static void weighted_sums(const float* w, int64_t w_stride, const int* kept, int n,
                            const float* inv, const float* v, int64_t v_ss, int Dv, float* out,
                            int64_t out_stride) {
    for (int d0 = 0; d0 < Dv; d0 += 64) {
      const int width = Dv - d0 < 64 ? Dv - d0 : 64;
      const float* vd = v + d0;
      float* od = out + d0;
      switch ((width + 15) / 16) {
        case 1: weighted_slice<R, 1>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
        case 2: weighted_slice<R, 2>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
        case 3: weighted_slice<R, 3>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
        default: weighted_slice<R, 4>(w, w_stride, kept, n, inv, vd, v_ss, width, od, out_stride); break;
      }
    }
  }

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

  // 16 keys' scores from the keys transposed (kt: [D][16], key j in lane j) for R rows
  // (rows[j]: row j's query at qs + rows[j] * D, its 16 scores to out + rows[j] *
  // out_stride), each block of keys loaded once for all of them. Each key's sum is grouped
  // exactly as score1 groups it: the partial P_l adds the products of d = l, l + 16, ... in
  // order, and the partials fold as _mm512_reduce_add_ps folds lanes, ((P_0 + P_8) + (P_4 +
  // P_12)) + ((P_2 + P_10) + (P_6 + P_14)), plus the same over the odd l; one partial at a
  // time, so that R rows' sums fit in registers. Same bits either path (the query count
  // picks it), so a row's result never shows which ran.
  template <int R>
  static void scores_block_rows(const float* qs, const int* rows, const float* kt, int D,
                                float* out, int64_t out_stride) {
    const float* q[R];
    for (int j = 0; j < R; ++j) q[j] = qs + int64_t(rows[j]) * D;
    const auto partial = [&](int l, __m512* p) {
      for (int j = 0; j < R; ++j) p[j] = _mm512_setzero_ps();
      for (int d = l; d < D; d += 16) {
        const __m512 kv = _mm512_loadu_ps(kt + d * 16);
        for (int j = 0; j < R; ++j) p[j] = _mm512_fmadd_ps(_mm512_set1_ps(q[j][d]), kv, p[j]);
      }
    };
    // A_l = P_{l+8} + P_l (l < 8)
    const auto pair8 = [&](int l, __m512* a) {
      __m512 lo[R], hi[R];
      partial(l, lo);
      partial(l + 8, hi);
      for (int j = 0; j < R; ++j) a[j] = _mm512_add_ps(hi[j], lo[j]);
    };
    // B_l = A_{l+4} + A_l (l < 4)
    const auto pair4 = [&](int l, __m512* b) {
      __m512 lo[R], hi[R];
      pair8(l, lo);
      pair8(l + 4, hi);
      for (int j = 0; j < R; ++j) b[j] = _mm512_add_ps(hi[j], lo[j]);
    };
    // C_l = B_l + B_{l+2} (l < 2)
    const auto pair2 = [&](int l, __m512* c) {
      __m512 lo[R], hi[R];
      pair4(l, lo);
      pair4(l + 2, hi);
      for (int j = 0; j < R; ++j) c[j] = _mm512_add_ps(lo[j], hi[j]);
    };
    __m512 c0[R], c1[R];
    pair2(0, c0);
    pair2(1, c1);
    for (int j = 0; j < R; ++j)
      _mm512_storeu_ps(out + int64_t(rows[j]) * out_stride, _mm512_add_ps(c0[j], c1[j]));
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

  template <bool MORE = false>
  static void weighted_sum(const float* w, const int* kept, int n, float inv, const float* v,
                           int64_t v_ss, int Dv, float* out) {
    for (int d0 = 0; d0 < Dv; d0 += 16 * kMaxRegSums) {
      const int width = Dv - d0 < 16 * kMaxRegSums ? Dv - d0 : 16 * kMaxRegSums;
      kRegSums<MORE>[(width + 15) / 16](w, kept, n, inv, v + d0, v_ss, width, out + d0);
    }
  }

  static void weighted_sum_more(const float* w, const int* kept, int n, float inv,
                                const float* v, int64_t v_ss, int Dv, float* out) {
    weighted_sum<true>(w, kept, n, inv, v, v_ss, Dv, out);
  }
};

}  // namespace

void attention_avx512(const AttnArgs& a, int64_t r0, int64_t r1) {
  attend<Avx512>(a, r0, r1);
}

}  // namespace mlxcel_native
