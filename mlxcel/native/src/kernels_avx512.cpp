// AVX-512 kernels (this file alone is compiled with -mavx512f/bw/vl/dq -mfma -mf16c; callers
// check the CPU first). Only intrinsics and this file's own internal-linkage code live here,
// so no AVX-512 instruction can leak into code that runs on other CPUs.
//
// Shape of the work: a tile of MR rows x NC output columns keeps MR*NC zmm accumulators of 16
// partial sums each; every 32 weights of a column are dequantised once into two zmm registers
// and FMA'd into all MR rows, so at 8 rows one dequantisation feeds 16 FMAs. At 1 row the
// kernel is bound by reading the packed weights, and NC=8 columns keep 8 streams in flight.
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "tile_plan.h"
#include "scales_avx512.h"
#include "kquant_block.h"

namespace mlxcel_native {
namespace {

// Scales and biases of one column for up to kGroupBlock groups, widened to float32 into a
// stack buffer (widen, scales_avx512.h), then one broadcast load per group in the tile's
// loop (a scalar half-to-float conversion per group and column cost ~20% of a 1-row call).
constexpr int kGroupBlock = 64;

// Rows [m0, m0+MR) x columns [n0, n0+NC); columns at or past n_end repeat the last valid
// column (their sums are discarded), so a ragged last tile needs no kernel of its own.
template <int BITS, int MR, int NC, ScaleType ST>
void q_tile(const QmmArgs& a, int m0, int n0, int n_end) {
  const int K = a.K;
  const int gs = a.group_size;
  const long G = K / gs;
  const uint8_t* wcol[NC];
  long col[NC];
  tile_columns<BITS, NC>(a, n0, n_end, col, wcol);
  const float* xrow[MR];
  for (int r = 0; r < MR; ++r) xrow[r] = a.x + long(m0 + r) * K;
  TilePrefetch<BITS, NC, ST> prefetch(a, n0);

  __m512 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();

  const __m512 iota =
      _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  alignas(64) float sbuf[NC][kGroupBlock];
  alignas(64) float bbuf[NC][kGroupBlock];
  const int chunks_per_group = gs / 32;
  for (long g0 = 0; g0 < G; g0 += kGroupBlock) {
    const int groups = G - g0 < kGroupBlock ? int(G - g0) : kGroupBlock;
    for (int c = 0; c < NC; ++c) {
      widen<ST>(a.scales, col[c] * G + g0, groups, sbuf[c]);
      widen<ST>(a.biases, col[c] * G + g0, groups, bbuf[c]);
    }
    // One flat loop over this block's 32-element chunks, the group's tables rebuilt at each
    // group start: with a loop per group, gcc kept the accumulators on the stack between
    // groups (32 stores and loads per group of 32 weights at g32).
    __m512 sv[NC], bv[NC];
    const long k_end = (g0 + groups) * gs;
    int chunk = 0;
    int gi = 0;
    for (long k = g0 * gs; k < k_end; k += 32) {
      if (chunk == 0) {
        // 4-bit: a 16-entry table of this group's dequantised values, indexed by the nibble
        // (vpermps reads only the low 4 bits of each index). 8-bit: scale and bias. (Measured
        // against and + cvtdq2ps + fma per 16 nibbles: 1536x576 at 1 row 74 vs 92 us.)
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          if constexpr (BITS == 4) {
            sv[c] = _mm512_fmadd_ps(
                _mm512_set1_ps(sbuf[c][gi]), iota, _mm512_set1_ps(bbuf[c][gi]));
          } else {
            sv[c] = _mm512_set1_ps(sbuf[c][gi]);
            bv[c] = _mm512_set1_ps(bbuf[c][gi]);
          }
        }
        ++gi;
      }
      if (++chunk == chunks_per_group) chunk = 0;
      prefetch.chunk();
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        __m512 w0, w1;
        if constexpr (BITS == 4) {
          // 16 bytes = 32 nibbles: low nibbles are the even elements, high ones the odd;
          // qmm_prepare_x put x in that order.
          const __m512i q = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(wcol[c] + k / 2)));
          w0 = _mm512_permutexvar_ps(q, sv[c]);
          w1 = _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), sv[c]);
        } else {
          const __m512i q0 = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(wcol[c] + k)));
          const __m512i q1 = _mm512_cvtepu8_epi32(
              _mm_loadu_si128(reinterpret_cast<const __m128i*>(wcol[c] + k + 16)));
          w0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), sv[c], bv[c]);
          w1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), sv[c], bv[c]);
        }
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
          acc[r][c] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xrow[r] + k), acc[r][c]);
          acc[r][c] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xrow[r] + k + 16), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC && n0 + c < n_end; ++c)
      a.out[long(m0 + r) * a.N + n0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// ---- Many rows: the output's columns as vectors over 16 rows ---------------------------
// From kRowsKernelMin rows on, the caller transposes x to xT [K, Mp] (Mp: M rounded up to 16,
// zero rows added; for 4-bit each 32-element chunk in qmm_prepare_x's order). A block of NC
// columns is dequantised once per kKBlock inputs into a buffer, and every 16-row vector of
// xT is FMA'd against a broadcast of each dequantised weight. One dequantisation feeds every
// row, nothing is reduced across lanes, and per k the loads are MV vectors of xT and NC
// broadcasts against MV*NC FMAs. (The tiles above redo the dequantisation for every 8 rows
// and keep 8 rows of x live, 48 KB at K=1536, more than L1: 0.7x of OpenBLAS at 16 rows.)
constexpr int kKBlock = 512;
constexpr int kWStride = kKBlock + 16;  // floats; breaks power-of-two strides between columns
constexpr int kSuperRows = 128;  // rows whose partial sums are kept between K blocks

// Columns col[0..NC) for inputs [kb, kb + kn) into wbuf[c * kWStride + (k - kb)].
template <int BITS, int NC, ScaleType ST>
void dequant_block(const QmmArgs& a, const long* col, long kb, int kn, float* wbuf) {
  const long G = a.K / a.group_size;
  const long row_bytes = long(a.K) * BITS / 8;
  const __m512 iota =
      _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int c = 0; c < NC; ++c) {
    const uint8_t* wc = reinterpret_cast<const uint8_t*>(a.w) + col[c] * row_bytes;
    float* dst = wbuf + c * kWStride - kb;
    for (long k = kb; k < kb + kn; k += 32) {
      const long g = col[c] * G + k / a.group_size;
      const float s = scale_at<ST>(a.scales, g);
      const float b = scale_at<ST>(a.biases, g);
      if constexpr (BITS == 4) {
        const __m512 table = _mm512_fmadd_ps(_mm512_set1_ps(s), iota, _mm512_set1_ps(b));
        const __m512i q =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + k / 2)));
        _mm512_store_ps(dst + k, _mm512_permutexvar_ps(q, table));
        _mm512_store_ps(dst + k + 16, _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table));
      } else {
        const __m512 sv = _mm512_set1_ps(s), bv = _mm512_set1_ps(b);
        const __m512i q0 =
            _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + k)));
        const __m512i q1 = _mm512_cvtepu8_epi32(
            _mm_loadu_si128(reinterpret_cast<const __m128i*>(wc + k + 16)));
        _mm512_store_ps(dst + k, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q0), sv, bv));
        _mm512_store_ps(dst + k + 16, _mm512_fmadd_ps(_mm512_cvtepi32_ps(q1), sv, bv));
      }
    }
  }
}

// MV vectors of 16 rows x NC columns over kn inputs; partial sums live in acc_io between K
// blocks ([MV][NC] vectors), zeroed first when `first`.
template <int MV, int NC>
void rows_tile(const float* xT, int Mp, const float* wbuf, int kn, __m512* acc_io, bool first) {
  __m512 acc[MV][NC];
#pragma GCC unroll 32
  for (int v = 0; v < MV; ++v)
#pragma GCC unroll 32
    for (int c = 0; c < NC; ++c)
      acc[v][c] = first ? _mm512_setzero_ps() : acc_io[v * NC + c];
  for (int k = 0; k < kn; ++k) {
    __m512 xv[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) xv[v] = _mm512_loadu_ps(xT + long(k) * Mp + 16 * v);
#pragma GCC unroll 32
    for (int c = 0; c < NC; ++c) {
      const __m512 w = _mm512_set1_ps(wbuf[c * kWStride + k]);
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) acc[v][c] = _mm512_fmadd_ps(xv[v], w, acc[v][c]);
    }
  }
#pragma GCC unroll 32
  for (int v = 0; v < MV; ++v)
#pragma GCC unroll 32
    for (int c = 0; c < NC; ++c) acc_io[v * NC + c] = acc[v][c];
}

// bfloat16 weights [N, K] of columns col[0..NC) for inputs [kb, kb + kn), widened to float32
// into wbuf as dequant_block lays them out (natural order; any K).
template <int NC>
void widen_bf16_block(const Bf16Args& a, const long* col, long kb, int kn, float* wbuf) {
  for (int c = 0; c < NC; ++c) {
    const uint16_t* src = a.w + col[c] * long(a.K) + kb;
    float* dst = wbuf + c * kWStride;
    for (int k = 0; k < kn; k += 16) {
      const __mmask16 m = kn - k >= 16 ? __mmask16(0xffff) : __mmask16((1u << (kn - k)) - 1);
      const __m256i h = _mm256_maskz_loadu_epi16(m, src + k);
      _mm512_store_ps(
          dst + k, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
    }
  }
}

// Columns [n0, n0 + NC) for every row (columns at or past n_end repeat the last valid one);
// `load(col, kb, kn, wbuf)` puts the block's weights in wbuf as float32.
template <int NC, class Args, class Load>
void rows_block(const Args& a, const float* xT, int Mp, int n0, int n_end, Load load) {
  long col[NC];
  for (int c = 0; c < NC; ++c) col[c] = n0 + c < n_end ? n0 + c : n_end - 1;
  alignas(64) float wbuf[NC * kWStride];
  alignas(64) __m512 acc[kSuperRows / 16 * NC];
  alignas(64) float lanes[16];
  for (int ms = 0; ms < Mp; ms += kSuperRows) {
    const int me = Mp - ms < kSuperRows ? Mp : ms + kSuperRows;
    for (long kb = 0; kb < a.K; kb += kKBlock) {
      const int kn = a.K - kb < kKBlock ? int(a.K - kb) : kKBlock;
      load(col, kb, kn, wbuf);
      for (int m = ms; m < me;) {
        __m512* acc_io = acc + (m - ms) / 16 * NC;
        const float* xk = xT + kb * Mp + m;
        if (me - m >= 32) {
          rows_tile<2, NC>(xk, Mp, wbuf, kn, acc_io, kb == 0);
          m += 32;
        } else {
          rows_tile<1, NC>(xk, Mp, wbuf, kn, acc_io, kb == 0);
          m += 16;
        }
      }
    }
    for (int m = ms; m < me; m += 16) {
      for (int c = 0; c < NC && n0 + c < n_end; ++c) {
        _mm512_store_ps(lanes, acc[(m - ms) / 16 * NC + c]);
        for (int i = 0; i < 16 && m + i < a.M; ++i) a.out[long(m + i) * a.N + n0 + c] = lanes[i];
      }
    }
  }
}

// 24 columns when one vector covers the rows (24 accumulators), else 12 (2 x 12).
constexpr int rows_cols(int M) {
  return M <= 16 ? 24 : 12;
}

template <int NC, int BITS, ScaleType ST>
void qmm_rows_block(const QmmArgs& a, const float* xT, int Mp, int n, int n1) {
  rows_block<NC>(a, xT, Mp, n, n1, [&a](const long* col, long kb, int kn, float* wbuf) {
    dequant_block<BITS, NC, ST>(a, col, kb, kn, wbuf);
  });
}

template <int BITS, ScaleType ST>
void qmm_rows_typed(const QmmArgs& a, const float* xT, int Mp, int n0, int n1) {
  const int nc = rows_cols(a.M);
  for (int n = n0; n < n1; n += nc) {
    if (nc == 24) {
      qmm_rows_block<24, BITS, ST>(a, xT, Mp, n, n1);
    } else {
      qmm_rows_block<12, BITS, ST>(a, xT, Mp, n, n1);
    }
  }
}

template <int NC>
void bf16_rows_block(const Bf16Args& a, const float* xT, int Mp, int n, int n1) {
  rows_block<NC>(a, xT, Mp, n, n1, [&a](const long* col, long kb, int kn, float* wbuf) {
    widen_bf16_block<NC>(a, col, kb, kn, wbuf);
  });
}

template <int BITS>
void qmm_rows_bits(const QmmArgs& a, const float* xT, int Mp, int n0, int n1) {
  switch (a.scale_type) {
    case ScaleType::f32: return qmm_rows_typed<BITS, ScaleType::f32>(a, xT, Mp, n0, n1);
    case ScaleType::f16: return qmm_rows_typed<BITS, ScaleType::f16>(a, xT, Mp, n0, n1);
    case ScaleType::bf16: return qmm_rows_typed<BITS, ScaleType::bf16>(a, xT, Mp, n0, n1);
  }
}

// A compile-time flag (no <type_traits>: this file includes nothing with inline code).
template <bool B>
struct Masked {
  static constexpr bool value = B;
};

template <int MR, int NC>
void bf16_tile(const Bf16Args& a, int m0, int n0, int n_end) {
  const int K = a.K;
  const uint16_t* wcol[NC];
  for (int c = 0; c < NC; ++c)
    wcol[c] = a.w + long(n0 + c < n_end ? n0 + c : n_end - 1) * K;
  const float* xrow[MR];
  for (int r = 0; r < MR; ++r) xrow[r] = a.x + long(m0 + r) * K;
  __m512 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  // Full 16-element chunks unmasked, then one masked chunk for a ragged end of K (zeros add
  // nothing): with the mask computed in the main loop gcc spilled every accumulator per chunk.
  const auto step = [&](int k, __mmask16 m, auto masked) __attribute__((always_inline)) {
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      // bfloat16 is the high half of a float32: widen and shift.
      __m256i h;
      if constexpr (decltype(masked)::value) {
        h = _mm256_maskz_loadu_epi16(m, wcol[c] + k);
      } else {
        h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wcol[c] + k));
      }
      const __m512 w = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r) {
        if constexpr (decltype(masked)::value) {
          acc[r][c] = _mm512_fmadd_ps(w, _mm512_maskz_loadu_ps(m, xrow[r] + k), acc[r][c]);
        } else {
          acc[r][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xrow[r] + k), acc[r][c]);
        }
      }
    }
  };
  int k = 0;
  for (; k + 16 <= K; k += 16) step(k, __mmask16(0xffff), Masked<false>{});
  if (k < K) step(k, __mmask16((1u << (K - k)) - 1), Masked<true>{});
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC && n0 + c < n_end; ++c)
      a.out[long(m0 + r) * a.N + n0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// Tiles by row count: 1-2 rows read-bound (8 columns in flight); 3-4 rows 4x4; 5+ rows in
// blocks of 8 rows x 2 columns (the remainder rows use 2 columns too), 16 or fewer
// accumulators, so every tile fits the 32 zmm registers with room for weights.
constexpr int tile_cols(int M) {
  return M <= 2 ? 8 : M <= 4 ? 4 : 2;
}

template <class Args, class Tile>
void run_tiles(const Args& a, int n0, int n1, Tile tile) {
  const int nc = tile_cols(a.M);
  for (int n = n0; n < n1; n += nc) {
    for (int m = 0; m < a.M;) {
      const int rows = a.M - m >= 8 ? 8 : a.M - m;
      tile(rows, m, n, n1);
      m += rows;
    }
  }
}

template <int BITS, ScaleType ST>
void qmm_typed(const QmmArgs& a, int n0, int n1) {
  const int nc = tile_cols(a.M);
  run_tiles(a, n0, n1, [&](int rows, int m, int n, int n_end) {
    if (nc == 8) {
      if (rows == 1) return q_tile<BITS, 1, 8, ST>(a, m, n, n_end);
      return q_tile<BITS, 2, 8, ST>(a, m, n, n_end);
    }
    if (nc == 4) {
      if (rows == 3) return q_tile<BITS, 3, 4, ST>(a, m, n, n_end);
      return q_tile<BITS, 4, 4, ST>(a, m, n, n_end);
    }
    switch (rows) {
      case 1: return q_tile<BITS, 1, 2, ST>(a, m, n, n_end);
      case 2: return q_tile<BITS, 2, 2, ST>(a, m, n, n_end);
      case 3: return q_tile<BITS, 3, 2, ST>(a, m, n, n_end);
      case 4: return q_tile<BITS, 4, 2, ST>(a, m, n, n_end);
      case 5: return q_tile<BITS, 5, 2, ST>(a, m, n, n_end);
      case 6: return q_tile<BITS, 6, 2, ST>(a, m, n, n_end);
      case 7: return q_tile<BITS, 7, 2, ST>(a, m, n, n_end);
      default: return q_tile<BITS, 8, 2, ST>(a, m, n, n_end);
    }
  });
}

template <int BITS>
void qmm_bits(const QmmArgs& a, int n0, int n1) {
  switch (a.scale_type) {
    case ScaleType::f32: return qmm_typed<BITS, ScaleType::f32>(a, n0, n1);
    case ScaleType::f16: return qmm_typed<BITS, ScaleType::f16>(a, n0, n1);
    case ScaleType::bf16: return qmm_typed<BITS, ScaleType::bf16>(a, n0, n1);
  }
}

// ---- K-quant blocks -----------------------------------------------------------------------
// Each column's block is decoded once per tile (F::decode: int8 codes and float32 scales, and
// offsets for formats with mins), then per 16 weights one widen, convert and multiply (or
// multiply-add) gives a zmm of weights that is FMA'd into all MR rows, as q_tile does with a
// group of 32.
template <class F>
inline __m512 kq_weights16(const int8_t* q, float s, float m) {
  const __m512 codes = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q))));
  if constexpr (F::kMins) return _mm512_fmadd_ps(codes, _mm512_set1_ps(s), _mm512_set1_ps(m));
  return _mm512_mul_ps(codes, _mm512_set1_ps(s));
}

template <class F, int MR, int NC>
void kq_tile(const KQuantArgs& a, int m0, int n0, int n_end) {
  const long row_bytes = long(a.K) / 256 * F::kBytes;
  const uint8_t* wcol[NC];
  for (int c = 0; c < NC; ++c)
    wcol[c] = a.w + long(n0 + c < n_end ? n0 + c : n_end - 1) * row_bytes;
  const float* xrow[MR];
  for (int r = 0; r < MR; ++r) xrow[r] = a.x + long(m0 + r) * a.K;
  __m512 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  alignas(64) int8_t q[NC][256];
  alignas(64) float s[NC][16];
  alignas(64) float mn[NC][16];
  const long blocks = a.K / 256;
  const long ahead_col = long(n0) + long(kPrefetchTiles) * NC;
  const bool prefetch = ahead_col + NC <= a.N;
  const char* ahead = reinterpret_cast<const char*>(a.w + (prefetch ? ahead_col : 0) * row_bytes);
  const long ahead_lines = prefetch ? NC * row_bytes / 64 : 0;
  const long ahead_per_block = (ahead_lines + blocks - 1) / blocks;
  long ahead_next = 0;
  for (long b = 0; b < blocks; ++b) {
    // The tile kPrefetchTiles ahead (its NC rows are contiguous), a block's share of its lines
    // per block, as TilePrefetch does for the affine kernels: one stream far enough ahead to
    // cover the memory's latency at 1 row, where each column's own stream was not.
    for (long i = 0; i < ahead_per_block && ahead_next < ahead_lines; ++i, ++ahead_next)
      _mm_prefetch(ahead + ahead_next * 64, _MM_HINT_T0);
    for (int c = 0; c < NC; ++c) {
      if constexpr (F::kMins) {
        F::scales(wcol[c] + b * F::kBytes, s[c], mn[c]);  // per 32 here
      } else {
        F::decode(wcol[c] + b * F::kBytes, q[c], s[c], mn[c]);
      }
    }
    const long k0 = b * 256;
    if constexpr (F::kMins) {
      // Q4_K: the nibbles read as stored, 16 bytes widened once for 32 weights (the low
      // nibbles are weights 64i + 16h + [0, 16), the high ones 32 further on), and each
      // weight looked up in a 16-entry table of its sub-block's values (vpermps reads only an
      // index's low 4 bits), as q_tile does for a 4-bit group.
      const __m512 iota = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
      for (int i = 0; i < 4; ++i) {
#pragma GCC unroll 8
        for (int c = 0; c < NC; ++c) {
          // Sub-blocks 2i (the low nibbles) and 2i + 1 (the high ones), built per column so
          // that only two tables are live beside the accumulators.
          const __m512 tlo =
              _mm512_fmadd_ps(_mm512_set1_ps(s[c][2 * i]), iota, _mm512_set1_ps(mn[c][2 * i]));
          const __m512 thi = _mm512_fmadd_ps(_mm512_set1_ps(s[c][2 * i + 1]), iota,
                                             _mm512_set1_ps(mn[c][2 * i + 1]));
#pragma GCC unroll 2
          for (int h = 0; h < 2; ++h) {
            const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(
                wcol[c] + b * F::kBytes + 16 + 32 * i + 16 * h)));
            const __m512 wl = _mm512_permutexvar_ps(v, tlo);
            const __m512 wh = _mm512_permutexvar_ps(_mm512_srli_epi32(v, 4), thi);
            const long k = k0 + 64 * i + 16 * h;
#pragma GCC unroll 8
            for (int r = 0; r < MR; ++r) {
              acc[r][c] = _mm512_fmadd_ps(wl, _mm512_loadu_ps(xrow[r] + k), acc[r][c]);
              acc[r][c] = _mm512_fmadd_ps(wh, _mm512_loadu_ps(xrow[r] + k + 32), acc[r][c]);
            }
          }
        }
      }
      continue;
    }
    for (int j = 0; j < 16; ++j) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const __m512 w = kq_weights16<F>(q[c] + 16 * j, s[c][j], mn[c][j]);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
          acc[r][c] = _mm512_fmadd_ps(w, _mm512_loadu_ps(xrow[r] + k0 + 16 * j), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC && n0 + c < n_end; ++c)
      a.out[long(m0 + r) * a.N + n0 + c] = _mm512_reduce_add_ps(acc[r][c]);
}

// Columns col[0..NC) for inputs [kb, kb + kn) (whole blocks) into wbuf as float32, for the
// rows kernel.
template <class F, int NC>
void kq_dequant_block(const KQuantArgs& a, const long* col, long kb, int kn, float* wbuf) {
  const long row_bytes = long(a.K) / 256 * F::kBytes;
  alignas(64) int8_t q[256];
  alignas(64) float s[16];
  alignas(64) float mn[16];
  for (int c = 0; c < NC; ++c) {
    for (long k = kb; k < kb + kn; k += 256) {
      F::decode(a.w + col[c] * row_bytes + k / 256 * F::kBytes, q, s, mn);
      float* dst = wbuf + c * kWStride + (k - kb);
      for (int j = 0; j < 16; ++j)
        _mm512_store_ps(dst + 16 * j, kq_weights16<F>(q + 16 * j, s[j], mn[j]));
    }
  }
}

template <class F, int NC>
void kq_rows_block(const KQuantArgs& a, const float* xT, int Mp, int n, int n1) {
  rows_block<NC>(a, xT, Mp, n, n1, [&a](const long* col, long kb, int kn, float* wbuf) {
    kq_dequant_block<F, NC>(a, col, kb, kn, wbuf);
  });
}

template <class F>
void kq_tiles(const KQuantArgs& a, int n0, int n1) {
  const int nc = tile_cols(a.M);
  run_tiles(a, n0, n1, [&](int rows, int m, int n, int n_end) {
    if (nc == 8) {
      if (rows == 1) return kq_tile<F, 1, 8>(a, m, n, n_end);
      return kq_tile<F, 2, 8>(a, m, n, n_end);
    }
    if (nc == 4) {
      if (rows == 3) return kq_tile<F, 3, 4>(a, m, n, n_end);
      return kq_tile<F, 4, 4>(a, m, n, n_end);
    }
    switch (rows) {
      case 1: return kq_tile<F, 1, 2>(a, m, n, n_end);
      case 2: return kq_tile<F, 2, 2>(a, m, n, n_end);
      case 3: return kq_tile<F, 3, 2>(a, m, n, n_end);
      case 4: return kq_tile<F, 4, 2>(a, m, n, n_end);
      case 5: return kq_tile<F, 5, 2>(a, m, n, n_end);
      case 6: return kq_tile<F, 6, 2>(a, m, n, n_end);
      case 7: return kq_tile<F, 7, 2>(a, m, n, n_end);
      default: return kq_tile<F, 8, 2>(a, m, n, n_end);
    }
  });
}

}  // namespace

void kq_avx512(const KQuantArgs& a, int n0, int n1) {
  with_format(a.format, [&]<class F>() { kq_tiles<F>(a, n0, n1); });
}

void kq_rows_avx512(const KQuantArgs& a, const float* xT, int Mp, int n0, int n1) {
  const int nc = rows_cols(a.M);
  with_format(a.format, [&]<class F>() {
    for (int n = n0; n < n1; n += nc) {
      if (nc == 24) {
        kq_rows_block<F, 24>(a, xT, Mp, n, n1);
      } else {
        kq_rows_block<F, 12>(a, xT, Mp, n, n1);
      }
    }
  });
}

int avx512_tile_cols(int M) {
  return M >= kRowsKernelMin ? rows_cols(M) : tile_cols(M);
}

void qmm_rows_avx512(const QmmArgs& a, const float* xT, int Mp, int n0, int n1) {
  if (a.bits == 4) return qmm_rows_bits<4>(a, xT, Mp, n0, n1);
  return qmm_rows_bits<8>(a, xT, Mp, n0, n1);
}

void bf16mm_rows_avx512(const Bf16Args& a, const float* xT, int Mp, int n0, int n1) {
  const int nc = rows_cols(a.M);
  for (int n = n0; n < n1; n += nc) {
    if (nc == 24) {
      bf16_rows_block<24>(a, xT, Mp, n, n1);
    } else {
      bf16_rows_block<12>(a, xT, Mp, n, n1);
    }
  }
}

void qmm_avx512(const QmmArgs& a, int n0, int n1) {
  if (a.bits == 4) return qmm_bits<4>(a, n0, n1);
  return qmm_bits<8>(a, n0, n1);
}

void bf16mm_avx512(const Bf16Args& a, int n0, int n1) {
  const int nc = tile_cols(a.M);
  run_tiles(a, n0, n1, [&](int rows, int m, int n, int n_end) {
    if (nc == 8) {
      if (rows == 1) return bf16_tile<1, 8>(a, m, n, n_end);
      return bf16_tile<2, 8>(a, m, n, n_end);
    }
    if (nc == 4) {
      if (rows == 3) return bf16_tile<3, 4>(a, m, n, n_end);
      return bf16_tile<4, 4>(a, m, n, n_end);
    }
    switch (rows) {
      case 1: return bf16_tile<1, 2>(a, m, n, n_end);
      case 2: return bf16_tile<2, 2>(a, m, n, n_end);
      case 3: return bf16_tile<3, 2>(a, m, n, n_end);
      case 4: return bf16_tile<4, 2>(a, m, n, n_end);
      case 5: return bf16_tile<5, 2>(a, m, n, n_end);
      case 6: return bf16_tile<6, 2>(a, m, n, n_end);
      case 7: return bf16_tile<7, 2>(a, m, n, n_end);
      default: return bf16_tile<8, 2>(a, m, n, n_end);
    }
  });
}

}  // namespace mlxcel_native
