// Attention's row loop, the part that does not depend on the vector width: which keys a query
// row sees (causal, masks), their scores, the softmax and the weighted sum of the values, with
// the vector work done by V (attention_avx512.cpp's and attention_avx2.cpp's). Included by those
// translation units only, each with its own instruction set: everything here has internal
// linkage, so no copy is shared between them (kernels.h).
//
// V provides:
//   kLanes                                  keys scored at once by scores_block_rows
//   float score1(qs, ks, D)                 one key's score
//   void scores_block_rows<R>(qs, rows, kt, D, out, out_stride)
//                                           R rows' scores of kLanes keys from kt [D][kLanes]
//                                           (key j in lane j), each with score1's bits
//   float exp_sum(scores, n, mx)            scores[i] = exp(scores[i] - mx) in place; their sum
//   void weighted_sum(w, kept, n, inv, v, v_ss, Dv, out)
//                                           out = sum_i w[i] * inv * v[kept[i]], each element's
//                                           terms added in key order
//   void weighted_sum_more(w, kept, n, inv, v, v_ss, Dv, out)
//                                           the same, going on from the sums already in out
//                                           (weighted_sum's bits when out starts at zero)
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>

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

// Many query rows per KV head (prompts; decode with wide GQA): each KV head's keys are
// transposed once into blocks of L keys and scored L at a time (scores_block_rows), ~2x the
// one-key path's rate. Rows are taken kRowBlock at a time (consecutive rows of one head:
// a prompt's queries), and each block of keys, then each block of values, serves all of
// them while it is in L1: one row at a time, every row streamed the head's whole keys and
// values (2 MB at 4,000 keys) from L2 or memory, and at 4,000 tokens of context 92 % of a
// prompt chunk's time went there. Every row goes through the same operations in the same
// order as alone (score1's sums, the mask, exp_sum, each element's weighted terms in
// key order, paused between value blocks: a float32 stored and reloaded is the same
// value), so it gets the same bits.
template <class V>
void attend_blocked(const AttnArgs& a, int64_t r0, int64_t r1) {
  constexpr int L = V::kLanes;
  constexpr int kRowBlock = 16;
  constexpr int kValueBlock = 64;  // keys; at Dv 64, 16 KB of values
  const int rep = a.H / a.KVH;
  const int blocks = (a.S + L - 1) / L;
  const size_t Sp = size_t(blocks) * L;  // room for the last block's L scores
  thread_local Scratch<float> qs_buf, scores_buf, kt_buf, acc_buf, stat_buf;
  thread_local Scratch<int> kept_buf, count_buf;
  float* qs = qs_buf.get(size_t(kRowBlock) * a.D);
  float* scores = scores_buf.get(kRowBlock * Sp);
  int* kept = kept_buf.get(kRowBlock * Sp);
  float* acc = acc_buf.get(size_t(kRowBlock) * a.Dv);
  float* inv = stat_buf.get(kRowBlock);
  int* count = count_buf.get(size_t(4) * kRowBlock);  // kept keys, read so far, s_end
  int* pos = count + kRowBlock;
  int* ends = pos + kRowBlock;
  int* dense = ends + kRowBlock;  // every key up to s_end kept
  float* kt = kt_buf.get(size_t(blocks) * a.D * L);
  const float* kt_for = nullptr;  // whose keys kt holds, in this call
  const float neg_inf = -__builtin_inff();
  for (int64_t r = r0; r < r1;) {
    const int64_t bh = r / a.Lq;  // b * H + h
    int64_t r_end = (bh + 1) * a.Lq < r1 ? (bh + 1) * a.Lq : r1;
    if (r_end - r > kRowBlock) r_end = r + kRowBlock;
    const int rows = int(r_end - r);
    const int64_t b = bh / a.H, h = bh % a.H, g = h / rep;
    const float* k = a.k + b * a.k_sb + g * a.k_sh;
    const float* v = a.v + b * a.v_sb + g * a.v_sh;
    if (kt_for != k) {
      for (size_t j = 0; j < size_t(blocks) * a.D * L; ++j) kt[j] = 0.0f;
      for (int s = 0; s < a.S; ++s) {
        float* dst = kt + size_t(s / L) * a.D * L + (s % L);
        const float* src = k + s * a.k_ss;
        for (int d = 0; d < a.D; ++d) dst[d * L] = src[d];
      }
      kt_for = k;
    }
    int max_end = 0;
    for (int j = 0; j < rows; ++j) {
      const int64_t i = (r + j) % a.Lq;
      const float* q = a.q + b * a.q_sb + h * a.q_sh + i * a.q_sl;
      // As mlx's own: the query is scaled first, then dotted with each key.
      for (int d = 0; d < a.D; ++d) qs[size_t(j) * a.D + d] = a.scale * q[d];
      ends[j] = a.causal ? int(a.S - a.Lq + i + 1) : a.S;
      if (ends[j] > max_end) max_end = ends[j];
    }
    // Raw scores, a block of keys at a time for every row that sees it, kScoreRows rows
    // sharing each load of the block.
    constexpr int SR = V::kScoreRows;
    for (int s0 = 0; s0 < max_end; s0 += L) {
      const float* kb = kt + size_t(s0 / L) * a.D * L;
      int seen[kRowBlock];
      int m = 0;
      for (int j = 0; j < rows; ++j)
        if (s0 < ends[j]) seen[m++] = j;
      int j = 0;
      for (; j + SR <= m; j += SR)
        V::template scores_block_rows<SR>(qs, seen + j, kb, a.D, scores + s0, int64_t(Sp));
      for (; j < m; ++j)
        V::template scores_block_rows<1>(qs, seen + j, kb, a.D, scores + s0, int64_t(Sp));
    }
    // Per row: the mask (kept keys compacted in place), the softmax's sum.
    for (int j = 0; j < rows; ++j) {
      const int64_t i = (r + j) % a.Lq;
      const int64_t m0 = b * a.m_sb + h * a.m_sh + i * a.m_sl;
      float* sj = scores + j * Sp;
      int* kj = kept + j * Sp;
      int n = 0;
      float mx = neg_inf;
      // A prompt's bool mask usually keeps every key the causal bound leaves (no padding):
      // one memchr then stands for the per-key test, and the kept keys are 0..end-1.
      dense[j] = a.add == nullptr &&
                 (a.keep == nullptr ||
                  (a.m_ss == 1 && std::memchr(a.keep + m0, 0, size_t(ends[j])) == nullptr));
      if (dense[j]) {
        for (int s = 0; s < ends[j]; ++s) {
          kj[s] = s;
          if (sj[s] > mx) mx = sj[s];
        }
        n = ends[j];
      }
      for (int s = dense[j] ? ends[j] : 0; s < ends[j]; ++s) {
        float sc = sj[s];
        if (a.keep != nullptr && !a.keep[m0 + s * a.m_ss]) continue;
        if (a.add != nullptr) {
          const float bias = a.add[m0 + s * a.m_ss];
          if (bias == neg_inf) continue;
          sc += bias;
        }
        sj[n] = sc;
        kj[n++] = s;
        if (sc > mx) mx = sc;
      }
      count[j] = n;
      pos[j] = 0;
      // Every key masked: zeros (mlx's softmax gives NaN; zeros are kinder and rare).
      inv[j] = n == 0 ? 0.0f : 1.0f / V::exp_sum(sj, n, mx);
      for (int d = 0; d < a.Dv; ++d) acc[size_t(j) * a.Dv + d] = 0.0f;
    }
    // The weighted values, a block of values at a time for every row that keeps some.
    for (int t0 = 0; t0 < max_end; t0 += kValueBlock) {
      for (int j = 0; j < rows; ++j) {
        const int* kj = kept + j * Sp;
        int p = pos[j];
        int e = p;
        if (dense[j]) {  // kept keys 0..count-1
          e = count[j] < t0 + kValueBlock ? count[j] : t0 + kValueBlock;
        } else {
          while (e < count[j] && kj[e] < t0 + kValueBlock) ++e;
        }
        if (e > p)
          V::weighted_sum_more(scores + j * Sp + p, kj + p, e - p, inv[j], v, a.v_ss, a.Dv,
                               acc + size_t(j) * a.Dv);
        pos[j] = e;
      }
    }
    for (int j = 0; j < rows; ++j) {
      float* out = a.out + (r + j) * a.Dv;
      for (int d = 0; d < a.Dv; ++d) out[d] = acc[size_t(j) * a.Dv + d];
    }
    r = r_end;
  }
}

template <class V>
void attend_rows(const AttnArgs& a, int64_t r0, int64_t r1) {
  if (attention_blocked(a)) return attend_blocked<V>(a, r0, r1);
  const int rep = a.H / a.KVH;
  // Few query rows per KV head (decode): one key at a time. Per thread, reused: the query
  // scaled, the kept keys' scores and positions.
  thread_local Scratch<float> qs_buf, scores_buf;
  thread_local Scratch<int> kept_buf;
  float* qs = qs_buf.get(a.D);
  float* scores = scores_buf.get(a.S);
  int* kept = kept_buf.get(a.S);
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
    for (int s = 0; s < s_end; ++s) admit(s, V::score1(qs, k + s * a.k_ss, a.D));
    float* out = a.out + r * a.Dv;
    if (n == 0) {  // every key masked: mlx's softmax gives NaN; zeros are kinder and rare
      for (int d = 0; d < a.Dv; ++d) out[d] = 0.0f;
      continue;
    }
    const float inv = 1.0f / V::exp_sum(scores, n, mx);
    V::weighted_sum(scores, kept, n, inv, v, a.v_ss, a.Dv, out);
  }
}

// Units [u0, u1) of a grouped call (AttnArgs::grouped): the rep query heads of KV head g at
// query i, u = (b * KVH + g) * Lq + i. Their keys and values are read once for all of them
// rather than once per head: in decode at long contexts the keys and values come from
// memory (a 4,000-token SmolLM2 cache is ~180 MB a step), so each read saved is time saved.
// Every row goes through attend_rows' operations in its order (score1's sums, the mask
// applied, exp_sum, weighted_sum per element in key order), so it gets the same bits.
//
// V provides, besides attend_rows' needs:
//   kGroup                               heads scored and weighed at once (register budget)
//   void scores_rows<R>(qs, D, k, k_ss, n, out, out_stride)
//                                        R heads' raw scores of keys 0..n-1 (qs: R x D,
//                                        head j's at qs + j * D), each score1's bits
//   void weighted_sums<R>(w, w_stride, kept, n, inv, v, v_ss, Dv, out, out_stride)
//                                        R rows of weighted_sum at once, each with its bits
template <class V, int R>
void attend_heads(const AttnArgs& a, const float* qs, const float* k, int s_end, float* raw) {
  V::template scores_rows<R>(qs, a.D, k, a.k_ss, s_end, raw, a.S);
}

template <class V>
void attend_units(const AttnArgs& a, int64_t u0, int64_t u1) {
  const int rep = a.H / a.KVH;
  constexpr int G = V::kGroup;
  thread_local Scratch<float> qs_buf, raw_buf, scores_buf, stat_buf;
  thread_local Scratch<int> kept_buf;
  float* qs = qs_buf.get(size_t(rep) * a.D);
  float* raw = raw_buf.get(size_t(rep) * a.S);
  float* scores = scores_buf.get(size_t(rep) * a.S);
  float* mx = stat_buf.get(size_t(2) * rep);
  float* inv = mx + rep;
  int* kept = kept_buf.get(a.S);
  const float neg_inf = -__builtin_inff();
  for (int64_t u = u0; u < u1; ++u) {
    const int64_t i = u % a.Lq;
    const int64_t b = u / (int64_t(a.KVH) * a.Lq), g = (u / a.Lq) % a.KVH;
    const float* k = a.k + b * a.k_sb + g * a.k_sh;
    const float* v = a.v + b * a.v_sb + g * a.v_sh;
    const int64_t m0 = b * a.m_sb + i * a.m_sl;  // the same for every head (grouped)
    const int s_end = a.causal ? int(a.S - a.Lq + i + 1) : a.S;
    for (int j = 0; j < rep; ++j) {
      const float* q = a.q + b * a.q_sb + (g * rep + j) * a.q_sh + i * a.q_sl;
      for (int d = 0; d < a.D; ++d) qs[size_t(j) * a.D + d] = a.scale * q[d];
    }
    for (int j0 = 0; j0 < rep; j0 += G) {
      const float* qj = qs + size_t(j0) * a.D;
      float* rj = raw + size_t(j0) * a.S;
      switch (rep - j0 >= G ? G : rep - j0) {
        case 1: attend_heads<V, 1>(a, qj, k, s_end, rj); break;
        case 2: attend_heads<V, 2 <= G ? 2 : 1>(a, qj, k, s_end, rj); break;
        case 3: attend_heads<V, 3 <= G ? 3 : 1>(a, qj, k, s_end, rj); break;
        default: attend_heads<V, G>(a, qj, k, s_end, rj); break;
      }
    }
    // The mask, as attend_rows' admit: a dropped key is skipped, a bias added.
    for (int j = 0; j < rep; ++j) mx[j] = neg_inf;
    int n = 0;
    for (int s = 0; s < s_end; ++s) {
      float bias = 0.0f;
      if (a.keep != nullptr && !a.keep[m0 + s * a.m_ss]) continue;
      if (a.add != nullptr) {
        bias = a.add[m0 + s * a.m_ss];
        if (bias == neg_inf) continue;
      }
      for (int j = 0; j < rep; ++j) {
        float sc = raw[size_t(j) * a.S + s];
        if (a.add != nullptr) sc += bias;
        scores[size_t(j) * a.S + n] = sc;
        if (sc > mx[j]) mx[j] = sc;
      }
      kept[n++] = s;
    }
    float* out = a.out + ((b * a.H + g * rep) * a.Lq + i) * a.Dv;
    const int64_t out_stride = a.Lq * a.Dv;
    if (n == 0) {  // every key masked: zeros, as attend_rows
      for (int j = 0; j < rep; ++j)
        for (int d = 0; d < a.Dv; ++d) out[j * out_stride + d] = 0.0f;
      continue;
    }
    for (int j = 0; j < rep; ++j) inv[j] = 1.0f / V::exp_sum(scores + size_t(j) * a.S, n, mx[j]);
    for (int j0 = 0; j0 < rep; j0 += G) {
      const float* w = scores + size_t(j0) * a.S;
      float* o = out + j0 * out_stride;
      switch (rep - j0 >= G ? G : rep - j0) {
        case 1: V::template weighted_sums<1>(w, a.S, kept, n, inv + j0, v, a.v_ss, a.Dv, o, out_stride); break;
        case 2: V::template weighted_sums<2 <= G ? 2 : 1>(w, a.S, kept, n, inv + j0, v, a.v_ss, a.Dv, o, out_stride); break;
        case 3: V::template weighted_sums<3 <= G ? 3 : 1>(w, a.S, kept, n, inv + j0, v, a.v_ss, a.Dv, o, out_stride); break;
        default: V::template weighted_sums<G>(w, a.S, kept, n, inv + j0, v, a.v_ss, a.Dv, o, out_stride); break;
      }
    }
  }
}

template <class V>
void attend(const AttnArgs& a, int64_t r0, int64_t r1) {
  if (a.grouped) return attend_units<V>(a, r0, r1);
  attend_rows<V>(a, r0, r1);
}

}  // namespace
}  // namespace mlxcel_native
