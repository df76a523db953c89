// AVX2 kernels for CPUs without AVX-512 (this file is compiled with -mavx2 -mfma -mf16c and
// nothing more; callers check the CPU first). The same interfaces and the same shape of work
// as kernels_avx512.cpp, at half the vector width and half the registers (16 ymm):
//
// - Below kRowsKernelMin rows, register tiles of MR rows x NC columns with MR * NC = 8 (or
//   fewer) accumulators of 8 partial sums each: every 32 weights of a column are dequantised
//   once into four ymm registers (zero-extend, convert, one FMA with the group's scale and
//   bias: AVX2 has no 16-entry table lookup like AVX-512's vpermps) and FMA'd into all MR
//   rows. 8 accumulators of 4-cycle FMAs keep both FMA ports busy.
// - From kRowsKernelMin rows on, the rows kernel: x transposed to xT [K, Mp], weights
//   dequantised per block of columns into a buffer, 2 x 8 rows x 6 columns of accumulators
//   (12 of the 16 registers) against broadcasts of each weight.
//
// 4-bit weights are read in qmm_prepare_x's order (per 32-element chunk the 16 even elements,
// then the 16 odd ones): bytes 0-7's low nibbles are elements 0, 2, .. 14, bytes 8-15's are
// 16, .. 30, the high nibbles the odd ones, so one zero-extension of 8 bytes gives both.
#include <immintrin.h>

#include <cstdint>

#include "kernels.h"
#include "tile_plan.h"
#include "math_avx2.h"
#include "scale_at.h"
#include "kquant_block.h"

namespace mlxcel_native {
namespace {

constexpr int kGroupBlock = 64;

// `count` scales or biases from src[offset], widened to float32 into dst.
template <ScaleType ST>
inline void widen(const void* src, long offset, int count, float* dst) {
  int i = 0;
  for (; i + 8 <= count; i += 8) {
    __m256 v;
    if constexpr (ST == ScaleType::f32) {
      v = _mm256_loadu_ps(static_cast<const float*>(src) + offset + i);
    } else {
      const __m128i h = _mm_loadu_si128(
          reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + offset + i));
      if constexpr (ST == ScaleType::f16) {
        v = _mm256_cvtph_ps(h);
      } else {
        v = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
      }
    }
    _mm256_storeu_ps(dst + i, v);
  }
  for (; i < count; ++i) dst[i] = scale_at<ST>(src, offset + i);
}

inline __m256i zext8(const uint8_t* p) {
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}

// 32 weights from p (16 bytes at 4 bits, 32 at 8) as s * q + b into w[0..4), 4-bit in
// qmm_prepare_x's order.
template <int BITS>
inline void dequant32(const uint8_t* p, __m256 s, __m256 b, __m256* w) {
  if constexpr (BITS == 4) {
    const __m256i lo = zext8(p), hi = zext8(p + 8);
    const __m256i nib = _mm256_set1_epi32(15);
    w[0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(lo, nib)), s, b);
    w[1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(hi, nib)), s, b);
    w[2] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(lo, 4)), s, b);
    w[3] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(hi, 4)), s, b);
  } else {
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) w[j] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(zext8(p + 8 * j)), s, b);
  }
}

// Rows [m0, m0+MR) x columns [n0, n0+NC); columns at or past n_end repeat the last valid
// column (their sums are discarded).
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

  __m256 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();

  alignas(32) float sbuf[NC][kGroupBlock];
  alignas(32) float bbuf[NC][kGroupBlock];
  const int chunks_per_group = gs / 32;
  for (long g0 = 0; g0 < G; g0 += kGroupBlock) {
    const int groups = G - g0 < kGroupBlock ? int(G - g0) : kGroupBlock;
    for (int c = 0; c < NC; ++c) {
      widen<ST>(a.scales, col[c] * G + g0, groups, sbuf[c]);
      widen<ST>(a.biases, col[c] * G + g0, groups, bbuf[c]);
    }
    // One flat loop over the block's chunks (a loop per group made gcc keep the AVX-512
    // tiles' accumulators on the stack between groups).
    const long k_end = (g0 + groups) * gs;
    int chunk = 0;
    int gi = -1;
    for (long k = g0 * gs; k < k_end; k += 32) {
      if (chunk == 0) ++gi;
      if (++chunk == chunks_per_group) chunk = 0;
      prefetch.chunk();
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        __m256 w[4];
        dequant32<BITS>(wcol[c] + k * BITS / 8, _mm256_broadcast_ss(&sbuf[c][gi]),
                        _mm256_broadcast_ss(&bbuf[c][gi]), w);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
          for (int j = 0; j < 4; ++j)
            acc[r][c] = _mm256_fmadd_ps(w[j], _mm256_loadu_ps(xrow[r] + k + 8 * j), acc[r][c]);
        }
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC && n0 + c < n_end; ++c)
      a.out[long(m0 + r) * a.N + n0 + c] = hsum8(acc[r][c]);
}

template <int MR, int NC>
void bf16_tile(const Bf16Args& a, int m0, int n0, int n_end) {
  const int K = a.K;
  const uint16_t* wcol[NC];
  for (int c = 0; c < NC; ++c) wcol[c] = a.w + long(n0 + c < n_end ? n0 + c : n_end - 1) * K;
  const float* xrow[MR];
  for (int r = 0; r < MR; ++r) xrow[r] = a.x + long(m0 + r) * K;
  __m256 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  // bfloat16 is the high half of a float32: widen and shift.
  const auto widen8 = [](const uint16_t* p) __attribute__((always_inline)) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  };
  int k = 0;
  for (; k + 8 <= K; k += 8) {
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) {
      const __m256 w = widen8(wcol[c] + k);
#pragma GCC unroll 8
      for (int r = 0; r < MR; ++r)
        acc[r][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xrow[r] + k), acc[r][c]);
    }
  }
  if (k < K) {
    // A ragged end of K: zero-padded copies (zeros add nothing).
    const __m256i m = tail8(K - k);
    for (int c = 0; c < NC; ++c) {
      alignas(16) uint16_t wt[8] = {};
      for (int j = 0; j < K - k; ++j) wt[j] = wcol[c][k + j];
      const __m256 w = widen8(wt);
      for (int r = 0; r < MR; ++r)
        acc[r][c] = _mm256_fmadd_ps(w, _mm256_maskload_ps(xrow[r] + k, m), acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC && n0 + c < n_end; ++c)
      a.out[long(m0 + r) * a.N + n0 + c] = hsum8(acc[r][c]);
}

// Tiles by row count, 8 accumulators or fewer: 1 row x 8 columns (8 weight streams in
// flight, read-bound), 2 x 4, 3-4 x 2, then blocks of up to 8 rows x 1 column.
constexpr int tile_cols(int M) {
  return M <= 1 ? 8 : M <= 2 ? 4 : M <= 4 ? 2 : 1;
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

// Calls tile.template operator()<MR, NC>() for the tile that serves `rows` at width nc.
template <class Tile>
void pick_tile(int nc, int rows, Tile&& tile) {
  if (nc == 8) return tile.template operator()<1, 8>();
  if (nc == 4) return tile.template operator()<2, 4>();
  if (nc == 2) {
    if (rows == 3) return tile.template operator()<3, 2>();
    return tile.template operator()<4, 2>();
  }
  switch (rows) {
    case 1: return tile.template operator()<1, 1>();
    case 2: return tile.template operator()<2, 1>();
    case 3: return tile.template operator()<3, 1>();
    case 4: return tile.template operator()<4, 1>();
    case 5: return tile.template operator()<5, 1>();
    case 6: return tile.template operator()<6, 1>();
    case 7: return tile.template operator()<7, 1>();
    default: return tile.template operator()<8, 1>();
  }
}

template <int BITS, ScaleType ST>
void qmm_typed(const QmmArgs& a, int n0, int n1) {
  const int nc = tile_cols(a.M);
  run_tiles(a, n0, n1, [&](int rows, int m, int n, int n_end) {
    pick_tile(nc, rows, [&]<int MR, int NC>() { q_tile<BITS, MR, NC, ST>(a, m, n, n_end); });
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

// ---- Many rows: the output's columns as vectors over 8 rows ------------------------------
// As kernels_avx512.cpp's rows kernel: a block of kRowsCols columns dequantised once per
// kKBlock inputs into wbuf, every 16 rows of xT (two vectors) FMA'd against a broadcast of
// each weight: per k, 2 loads of x and 6 broadcasts against 12 FMAs.
constexpr int kKBlock = 512;
constexpr int kWStride = kKBlock + 16;  // floats; breaks power-of-two strides between columns
constexpr int kSuperRows = 128;  // rows whose partial sums are kept between K blocks
constexpr int kRowsCols = 6;

// Columns col[0..NC) for inputs [kb, kb + kn) into wbuf[c * kWStride + (k - kb)].
template <int BITS, int NC, ScaleType ST>
void dequant_block(const QmmArgs& a, const long* col, long kb, int kn, float* wbuf) {
  const long G = a.K / a.group_size;
  const long row_bytes = long(a.K) * BITS / 8;
  for (int c = 0; c < NC; ++c) {
    const uint8_t* wc = reinterpret_cast<const uint8_t*>(a.w) + col[c] * row_bytes;
    float* dst = wbuf + c * kWStride - kb;
    for (long k = kb; k < kb + kn; k += 32) {
      const long g = col[c] * G + k / a.group_size;
      __m256 w[4];
      dequant32<BITS>(wc + k * BITS / 8, _mm256_set1_ps(scale_at<ST>(a.scales, g)),
                      _mm256_set1_ps(scale_at<ST>(a.biases, g)), w);
      for (int j = 0; j < 4; ++j) _mm256_store_ps(dst + k + 8 * j, w[j]);
    }
  }
}

// bfloat16 weights of columns col[0..NC) for inputs [kb, kb + kn) into wbuf (any K).
template <int NC>
void widen_bf16_block(const Bf16Args& a, const long* col, long kb, int kn, float* wbuf) {
  for (int c = 0; c < NC; ++c) {
    const uint16_t* src = a.w + col[c] * long(a.K) + kb;
    float* dst = wbuf + c * kWStride;
    int k = 0;
    for (; k + 8 <= kn; k += 8) {
      const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + k));
      _mm256_store_ps(dst + k,
                      _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
    for (; k < kn; ++k) dst[k] = scale_at<ScaleType::bf16>(src, k);
  }
}

// MV vectors of 8 rows x NC columns over kn inputs; partial sums live in acc_io between K
// blocks ([MV][NC] vectors), zeroed first when `first`.
template <int MV, int NC>
void rows_tile(const float* xT, int Mp, const float* wbuf, int kn, __m256* acc_io, bool first) {
  __m256 acc[MV][NC];
#pragma GCC unroll 16
  for (int v = 0; v < MV; ++v)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[v][c] = first ? _mm256_setzero_ps() : acc_io[v * NC + c];
  for (int k = 0; k < kn; ++k) {
    __m256 xv[MV];
#pragma GCC unroll 4
    for (int v = 0; v < MV; ++v) xv[v] = _mm256_loadu_ps(xT + long(k) * Mp + 8 * v);
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) {
      const __m256 w = _mm256_broadcast_ss(wbuf + c * kWStride + k);
#pragma GCC unroll 4
      for (int v = 0; v < MV; ++v) acc[v][c] = _mm256_fmadd_ps(xv[v], w, acc[v][c]);
    }
  }
#pragma GCC unroll 16
  for (int v = 0; v < MV; ++v)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc_io[v * NC + c] = acc[v][c];
}

// Columns [n0, n0 + NC) for every row (Mp a multiple of 16); `load(col, kb, kn, wbuf)` puts
// the block's weights in wbuf as float32.
template <int NC, class Args, class Load>
void rows_block(const Args& a, const float* xT, int Mp, int n0, int n_end, Load load) {
  long col[NC];
  for (int c = 0; c < NC; ++c) col[c] = n0 + c < n_end ? n0 + c : n_end - 1;
  alignas(32) float wbuf[NC * kWStride];
  alignas(32) __m256 acc[kSuperRows / 8 * NC];
  alignas(32) float lanes[8];
  for (int ms = 0; ms < Mp; ms += kSuperRows) {
    const int me = Mp - ms < kSuperRows ? Mp : ms + kSuperRows;
    for (long kb = 0; kb < a.K; kb += kKBlock) {
      const int kn = a.K - kb < kKBlock ? int(a.K - kb) : kKBlock;
      load(col, kb, kn, wbuf);
      for (int m = ms; m < me; m += 16)
        rows_tile<2, NC>(xT + kb * Mp + m, Mp, wbuf, kn, acc + (m - ms) / 8 * NC, kb == 0);
    }
    for (int m = ms; m < me; m += 8) {
      for (int c = 0; c < NC && n0 + c < n_end; ++c) {
        _mm256_store_ps(lanes, acc[(m - ms) / 8 * NC + c]);
        for (int i = 0; i < 8 && m + i < a.M; ++i) a.out[long(m + i) * a.N + n0 + c] = lanes[i];
      }
    }
  }
}

template <int BITS, ScaleType ST>
void qmm_rows_typed(const QmmArgs& a, const float* xT, int Mp, int n0, int n1) {
  for (int n = n0; n < n1; n += kRowsCols) {
    rows_block<kRowsCols>(a, xT, Mp, n, n1, [&a](const long* col, long kb, int kn, float* wbuf) {
      dequant_block<BITS, kRowsCols, ST>(a, col, kb, kn, wbuf);
    });
  }
}

template <int BITS>
void qmm_rows_bits(const QmmArgs& a, const float* xT, int Mp, int n0, int n1) {
  switch (a.scale_type) {
    case ScaleType::f32: return qmm_rows_typed<BITS, ScaleType::f32>(a, xT, Mp, n0, n1);
    case ScaleType::f16: return qmm_rows_typed<BITS, ScaleType::f16>(a, xT, Mp, n0, n1);
    case ScaleType::bf16: return qmm_rows_typed<BITS, ScaleType::bf16>(a, xT, Mp, n0, n1);
  }
}

// ---- K-quant blocks -----------------------------------------------------------------------
// As kernels_avx512.cpp's: each column's block decoded once per tile, then per 8 weights one
// widen, convert and multiply (multiply-add with mins), FMA'd into all MR rows.
template <class F>
inline __m256 kq_weights8(const int8_t* q, float s, float m) {
  const __m256 codes = _mm256_cvtepi32_ps(
      _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q))));
  if constexpr (F::kMins) return _mm256_fmadd_ps(codes, _mm256_set1_ps(s), _mm256_set1_ps(m));
  return _mm256_mul_ps(codes, _mm256_set1_ps(s));
}

template <class F, int MR, int NC>
void kq_tile(const KQuantArgs& a, int m0, int n0, int n_end) {
  const long row_bytes = long(a.K) / 256 * F::kBytes;
  const uint8_t* wcol[NC];
  for (int c = 0; c < NC; ++c)
    wcol[c] = a.w + long(n0 + c < n_end ? n0 + c : n_end - 1) * row_bytes;
  const float* xrow[MR];
  for (int r = 0; r < MR; ++r) xrow[r] = a.x + long(m0 + r) * a.K;
  __m256 acc[MR][NC];
#pragma GCC unroll 8
  for (int r = 0; r < MR; ++r)
#pragma GCC unroll 8
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm256_setzero_ps();
  alignas(32) int8_t q[NC][256];
  alignas(32) float s[NC][16];
  alignas(32) float mn[NC][16];
  const long blocks = a.K / 256;
  for (long b = 0; b < blocks; ++b) {
    for (int c = 0; c < NC; ++c) {
      const uint8_t* ahead = wcol[c] + (b + 2) * F::kBytes;
      if (b + 2 < blocks)
        for (int line = 0; line < F::kBytes; line += 64) _mm_prefetch(ahead + line, _MM_HINT_T0);
      F::decode(wcol[c] + b * F::kBytes, q[c], s[c], mn[c]);
    }
    const long k0 = b * 256;
    for (int j = 0; j < 32; ++j) {
#pragma GCC unroll 8
      for (int c = 0; c < NC; ++c) {
        const __m256 w = kq_weights8<F>(q[c] + 8 * j, s[c][j / 2], mn[c][j / 2]);
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r)
          acc[r][c] = _mm256_fmadd_ps(w, _mm256_loadu_ps(xrow[r] + k0 + 8 * j), acc[r][c]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NC && n0 + c < n_end; ++c)
      a.out[long(m0 + r) * a.N + n0 + c] = hsum8(acc[r][c]);
}

// Columns col[0..NC) for inputs [kb, kb + kn) (whole blocks) into wbuf as float32.
template <class F, int NC>
void kq_dequant_block(const KQuantArgs& a, const long* col, long kb, int kn, float* wbuf) {
  const long row_bytes = long(a.K) / 256 * F::kBytes;
  alignas(32) int8_t q[256];
  alignas(32) float s[16];
  alignas(32) float mn[16];
  for (int c = 0; c < NC; ++c) {
    for (long k = kb; k < kb + kn; k += 256) {
      F::decode(a.w + col[c] * row_bytes + k / 256 * F::kBytes, q, s, mn);
      float* dst = wbuf + c * kWStride + (k - kb);
      for (int j = 0; j < 32; ++j)
        _mm256_store_ps(dst + 8 * j, kq_weights8<F>(q + 8 * j, s[j / 2], mn[j / 2]));
    }
  }
}

}  // namespace

void kq_avx2(const KQuantArgs& a, int n0, int n1) {
  const int nc = tile_cols(a.M);
  with_format(a.format, [&]<class F>() {
    run_tiles(a, n0, n1, [&](int rows, int m, int n, int n_end) {
      pick_tile(nc, rows, [&]<int MR, int NC>() { kq_tile<F, MR, NC>(a, m, n, n_end); });
    });
  });
}

void kq_rows_avx2(const KQuantArgs& a, const float* xT, int Mp, int n0, int n1) {
  with_format(a.format, [&]<class F>() {
    for (int n = n0; n < n1; n += kRowsCols) {
      rows_block<kRowsCols>(a, xT, Mp, n, n1, [&a](const long* col, long kb, int kn, float* wbuf) {
        kq_dequant_block<F, kRowsCols>(a, col, kb, kn, wbuf);
      });
    }
  });
}

int avx2_tile_cols(int M) {
  return M >= kRowsKernelMin ? kRowsCols : tile_cols(M);
}

void qmm_avx2(const QmmArgs& a, int n0, int n1) {
  if (a.bits == 4) return qmm_bits<4>(a, n0, n1);
  return qmm_bits<8>(a, n0, n1);
}

void bf16mm_avx2(const Bf16Args& a, int n0, int n1) {
  const int nc = tile_cols(a.M);
  run_tiles(a, n0, n1, [&](int rows, int m, int n, int n_end) {
    pick_tile(nc, rows, [&]<int MR, int NC>() { bf16_tile<MR, NC>(a, m, n, n_end); });
  });
}

void qmm_rows_avx2(const QmmArgs& a, const float* xT, int Mp, int n0, int n1) {
  if (a.bits == 4) return qmm_rows_bits<4>(a, xT, Mp, n0, n1);
  return qmm_rows_bits<8>(a, xT, Mp, n0, n1);
}

void bf16mm_rows_avx2(const Bf16Args& a, const float* xT, int Mp, int n0, int n1) {
  for (int n = n0; n < n1; n += kRowsCols) {
    rows_block<kRowsCols>(a, xT, Mp, n, n1, [&a](const long* col, long kb, int kn, float* wbuf) {
      widen_bf16_block<kRowsCols>(a, col, kb, kn, wbuf);
    });
  }
}

}  // namespace mlxcel_native
