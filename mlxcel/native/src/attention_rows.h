// Attention's row loop, the part that does not depend on the vector width: which keys a query
// row sees (causal, masks), their scores, the softmax and the weighted sum of the values, with
// the vector work done by V (attention_avx512.cpp's and attention_avx2.cpp's). Included by those
// translation units only, each with its own instruction set: everything here has internal
// linkage, so no copy is shared between them (kernels.h).
//
// V provides:
//   kLanes                                  keys scored at once by scores_block
//   float score1(qs, ks, D)                 one key's score
//   void scores_block(qs, kt, D, out)       kLanes keys' scores from kt [D][kLanes], each with
//                                           the bits score1 gives it
//   float exp_sum(scores, n, mx)            scores[i] = exp(scores[i] - mx) in place; their sum
//   void weighted_sum(w, kept, n, inv, v, v_ss, Dv, out)
//                                           out = sum_i w[i] * inv * v[kept[i]], each element's
//                                           terms added in key order
#pragma once

#include <cstdint>
#include <cstdlib>

#include "kernels.h"

namespace mlxcel_native {
namespace {

// A per-thread buffer that only grows. Not std::vector: its members are inline functions the
// linker merges across translation units, and a copy compiled with AVX-512 or AVX2 could then
// serve code that runs on CPUs without them.
template <class T>
struct Scratch {
  T* p = nullptr;
  size_t n = 0;
  T* get(size_t want) {
    if (want > n) {
      std::free(p);
      p = static_cast<T*>(std::malloc(want * sizeof(T)));
      n = want;
    }
    return p;
  }
  ~Scratch() {
    std::free(p);
  }
};

template <class V>
void attend_rows(const AttnArgs& a, int64_t r0, int64_t r1) {
  constexpr int L = V::kLanes;
  const int rep = a.H / a.KVH;
  // Per thread, reused: the query scaled, the kept keys' scores and positions, the keys
  // transposed.
  thread_local Scratch<float> qs_buf, scores_buf, kt_buf;
  thread_local Scratch<int> kept_buf;
  float* qs = qs_buf.get(a.D);
  float* scores = scores_buf.get(a.S);
  int* kept = kept_buf.get(a.S);
  // Many query rows per KV head (prompts; decode with wide GQA): each KV head's keys are
  // transposed once into blocks of L keys and scored L at a time (scores_block), ~2x the
  // one-key path's rate. kt_for: whose keys kt holds, in this call.
  const bool blocked = int64_t(rep) * a.Lq >= 8;
  const int blocks = (a.S + L - 1) / L;
  float* kt = blocked ? kt_buf.get(size_t(blocks) * a.D * L) : nullptr;
  const float* kt_for = nullptr;
  const float neg_inf = -__builtin_inff();
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
    // Keeps key s with score sc unless the mask drops it.
    const auto admit = [&](int s, float sc) {
      if (a.keep != nullptr && !a.keep[m0 + s * a.m_ss]) return;
      if (a.add != nullptr) {
        const float bias = a.add[m0 + s * a.m_ss];
        if (bias == neg_inf) return;
        sc += bias;
      }
      scores[n] = sc;
      kept[n++] = s;
      if (sc > mx) mx = sc;
    };
    if (blocked) {
      if (kt_for != k) {
        for (size_t j = 0; j < size_t(blocks) * a.D * L; ++j) kt[j] = 0.0f;
        for (int s = 0; s < a.S; ++s) {
          float* dst = kt + size_t(s / L) * a.D * L + (s % L);
          const float* src = k + s * a.k_ss;
          for (int d = 0; d < a.D; ++d) dst[d * L] = src[d];
        }
        kt_for = k;
      }
      alignas(64) float block[L];
      for (int s0 = 0; s0 < s_end; s0 += L) {
        V::scores_block(qs, kt + size_t(s0 / L) * a.D * L, a.D, block);
        for (int j = 0; j < L && s0 + j < s_end; ++j) admit(s0 + j, block[j]);
      }
    } else {
      for (int s = 0; s < s_end; ++s) admit(s, V::score1(qs, k + s * a.k_ss, a.D));
    }
    float* out = a.out + r * a.Dv;
    if (n == 0) {  // every key masked: mlx's softmax gives NaN; zeros are kinder and rare
      for (int d = 0; d < a.Dv; ++d) out[d] = 0.0f;
      continue;
    }
    const float inv = 1.0f / V::exp_sum(scores, n, mx);
    V::weighted_sum(scores, kept, n, inv, v, a.v_ss, a.Dv, out);
  }
}

}  // namespace
}  // namespace mlxcel_native
