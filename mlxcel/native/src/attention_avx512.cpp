// Attention with AVX-512, one query row at a time: see AttnArgs in kernels.h.
#include <immintrin.h>

#include <cmath>
#include <limits>
#include <vector>

#include "kernels.h"
#include "math_avx512.h"

namespace mlxcel_native {
namespace {

inline __mmask16 tail(int n) {
  return n >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << n) - 1);
}

// The scores of 16 keys at once, from the keys transposed (kt: [D][16], key j in lane j), each
// grouped exactly as the one-key path groups its sum: lane l of that path adds the products of
// d = l, l + 16, ... in order, then _mm512_reduce_add_ps folds the lanes (l with l + 8, then
// with l + 4, l + 2, l + 1). So both paths give a key the same bits, and which one runs (it
// depends on the query count) never shows in a result.
inline __m512 scores16(const float* qs, const float* kt, int D) {
  __m512 acc[16];
  for (int l = 0; l < 16; ++l) acc[l] = _mm512_setzero_ps();
  for (int d = 0; d < D; ++d)
    acc[d & 15] = _mm512_fmadd_ps(_mm512_set1_ps(qs[d]), _mm512_loadu_ps(kt + d * 16), acc[d & 15]);
  for (int l = 0; l < 8; ++l) acc[l] = _mm512_add_ps(acc[l + 8], acc[l]);
  for (int l = 0; l < 4; ++l) acc[l] = _mm512_add_ps(acc[l + 4], acc[l]);
  for (int l = 0; l < 2; ++l) acc[l] = _mm512_add_ps(acc[l], acc[l + 2]);
  return _mm512_add_ps(acc[0], acc[1]);
}

// One key's score: 16 lanes of partial sums, folded.
inline float score1(const float* qs, const float* ks, int D) {
  __m512 sum = _mm512_setzero_ps();
  for (int d = 0; d < D; d += 16) {
    const __mmask16 m = tail(D - d);
    sum = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, qs + d), _mm512_maskz_loadu_ps(m, ks + d), sum);
  }
  return _mm512_reduce_add_ps(sum);
}

// out[0, Dv) = sum_i w[i] * inv * v[kept[i]] with the sums held in NV registers (Dv <= 16 NV):
// each element adds its terms in key order, as the memory-held sum below does (same bits),
// without a store and reload per key (that chain, not the arithmetic, bounded it).
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
constexpr int kMaxRegSums = 8;  // head dims up to 128 (8 of the 32 vector registers)
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

}  // namespace

void attention_avx512(const AttnArgs& a, int64_t r0, int64_t r1) {
  const int rep = a.H / a.KVH;
  // Per thread, reused: the query scaled, the kept keys' scores and positions, the output sum.
  thread_local std::vector<float> qs, scores, acc, kt;
  thread_local std::vector<int> kept;
  qs.resize(a.D);
  scores.resize(a.S);
  kept.resize(a.S);
  acc.resize(a.Dv);
  // Many query rows per KV head (prompts; decode with wide GQA): each KV head's keys are
  // transposed once into 16-key blocks and scored 16 at a time (scores16), ~2x the one-key
  // path's rate. kt_for: whose keys kt holds, in this call.
  const bool blocked = int64_t(rep) * a.Lq >= 8;
  const int blocks = (a.S + 15) / 16;
  const float* kt_for = nullptr;
  const float neg_inf = -std::numeric_limits<float>::infinity();
  for (int64_t r = r0; r < r1; ++r) {
    const int64_t i = r % a.Lq;
    const int64_t b = r / (int64_t(a.H) * a.Lq), h = (r / a.Lq) % a.H, g = h / rep;
    const float* q = a.q + b * a.q_sb + h * a.q_sh + i * a.q_sl;
    const float* k = a.k + b * a.k_sb + g * a.k_sh;
    const float* v = a.v + b * a.v_sb + g * a.v_sh;
    const int64_t m0 = b * a.m_sb + h * a.m_sh + i * a.m_sl;
    const int s_end = a.causal ? int(a.S - a.Lq + i + 1) : a.S;
    // As mlx's own: the query is scaled first, then dotted with each key.
    for (int d = 0; d < a.D; ++d) qs[d] = a.scale * q[d];
    int n = 0;
    float mx = neg_inf;
    // Whether key s is kept, and the mask's addend for it.
    auto admit = [&](int s, float& bias) {
      bias = 0.0f;
      if (a.keep != nullptr && !a.keep[m0 + s * a.m_ss]) return false;
      if (a.add != nullptr) {
        bias = a.add[m0 + s * a.m_ss];
        if (bias == neg_inf) return false;
      }
      return true;
    };
    if (blocked) {
      if (kt_for != k) {
        kt.assign(size_t(blocks) * a.D * 16, 0.0f);
        for (int s = 0; s < a.S; ++s) {
          float* dst = kt.data() + size_t(s / 16) * a.D * 16 + (s & 15);
          const float* src = k + s * a.k_ss;
          for (int d = 0; d < a.D; ++d) dst[d * 16] = src[d];
        }
        kt_for = k;
      }
      alignas(64) float block[16];
      for (int s0 = 0; s0 < s_end; s0 += 16) {
        _mm512_store_ps(block, scores16(qs.data(), kt.data() + size_t(s0 / 16) * a.D * 16, a.D));
        for (int j = 0; j < 16 && s0 + j < s_end; ++j) {
          float bias;
          if (!admit(s0 + j, bias)) continue;
          const float sc = block[j] + bias;
          scores[n] = sc;
          kept[n++] = s0 + j;
          if (sc > mx) mx = sc;
        }
      }
    } else {
      for (int s = 0; s < s_end; ++s) {
        float bias;
        if (!admit(s, bias)) continue;
        const float sc = score1(qs.data(), k + s * a.k_ss, a.D) + bias;
        scores[n] = sc;
        kept[n++] = s;
        if (sc > mx) mx = sc;
      }
    }
    float* out = a.out + r * a.Dv;
    if (n == 0) {  // every key masked: mlx's softmax gives NaN; zeros are kinder and rare
      for (int d = 0; d < a.Dv; ++d) out[d] = 0.0f;
      continue;
    }
    // exp(score - max) in place, and their sum (lane-wise, then across lanes: a fixed order
    // over the kept keys alone).
    const __m512 vmax = _mm512_set1_ps(mx);
    __m512 total = _mm512_setzero_ps();
    for (int i = 0; i < n; i += 16) {
      const __mmask16 m = tail(n - i);
      const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores.data() + i), vmax));
      const __m512 e_kept = _mm512_maskz_mov_ps(m, e);
      _mm512_mask_storeu_ps(scores.data() + i, m, e_kept);
      total = _mm512_add_ps(total, e_kept);
    }
    const float inv = 1.0f / _mm512_reduce_add_ps(total);
    const int nv = (a.Dv + 15) / 16;
    if (nv <= kMaxRegSums) {
      kRegSums[nv](scores.data(), kept.data(), n, inv, v, a.v_ss, a.Dv, out);
      continue;
    }
    // Wider heads: the sum in memory.
    for (int d = 0; d < a.Dv; ++d) acc[d] = 0.0f;
    for (int i = 0; i < n; ++i) {
      const __m512 w = _mm512_set1_ps(scores[i] * inv);
      const float* vs = v + kept[i] * a.v_ss;
      for (int d = 0; d < a.Dv; d += 16) {
        const __mmask16 m = tail(a.Dv - d);
        _mm512_mask_storeu_ps(acc.data() + d, m,
                              _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, vs + d),
                                              _mm512_maskz_loadu_ps(m, acc.data() + d)));
      }
    }
    for (int d = 0; d < a.Dv; ++d) out[d] = acc[d];
  }
}

}  // namespace mlxcel_native
