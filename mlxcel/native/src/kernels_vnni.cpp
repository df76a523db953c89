// AVX512-VNNI kernel for many rows: integer dot products of the stored 4/8-bit weights with
// activations quantised to int8 (this file alone is compiled with -mavx512vnni on top of the
// AVX-512 flags; callers check the CPU first, as for kernels_avx512.cpp).
//
// Why: the float rows kernel (kernels_avx512.cpp) widens every weight to float32 and does one
// 16-lane FMA per 16 multiply-adds; at 64 rows a SmolLM2 decode step spends ~80% of its time
// there at ~28% of the FMA peak. vpdpbusd does 64 multiply-adds (unsigned 8-bit weight x
// signed 8-bit activation, summed 4 at a time into 16 int32 lanes) per instruction.
//
// Numerics, as llama.cpp's Q4_1 x Q8_1 dot products: each row's activations are quantised per
// 32-input block to int8 with one float scale d = max|x| / 127 (round to nearest), so a
// weight group's sum is  s * sum_blocks(d * int_dot(q, xq)) + b * sum_blocks(d * sum(xq)). A row's result depends only on that row (its own scales, a fixed
// order over K), never on the rows beside it or its place among them.
//
// Layout: lanes are 16 rows (as in the float rows kernel). xq is [Mp/16][K/4][16][4] int8, so
// one 64-byte load is 16 rows x 4 inputs and a tile's loads are one contiguous run; a column's 4
// weights for those inputs are one 32-bit broadcast. The int32 sums of one 32-input block are
// scaled into float accumulators once.
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "kernels.h"
#include "kquant_block.h"
#include "scales_avx512.h"

namespace mlxcel_native {
namespace {

// Where row m's values live in Int8Rows (kernels.h): tile-major, 16 rows a tile, so that a
// tile's activations are one contiguous run. Row-major [K/4][Mp][4] put a tile's successive
// 4-input slices Mp * 4 bytes apart: at 512 rows, 2 KB, which maps every one of them onto the
// same 2 sets of L1 and evicted them as fast as they were fetched.
inline long xq_at(int K, long kq, int m) {
  return ((long(m / 16) * (K / 4) + kq) * 16 + m % 16) * 4;
}
inline long d_at(int K, long blk, int m) { return (long(m / 16) * (K / 32) + blk) * 16 + m % 16; }
inline long sums_at(int G, long g, int m) { return (long(m / 16) * G + g) * 16 + m % 16; }

inline int load_u32(const uint8_t* p) {
  int v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

// One column's weights as bytes: 8-bit ones as stored; 4-bit ones unpacked into dst in
// Int8Rows' `nibbles` order (mlx packs input 2i in the low nibble of byte i and 2i+1 in the
// high one, so a 32-input block's 16 bytes give its even inputs as their low nibbles and its
// odd ones as their high nibbles: no byte interleaving, 64 packed bytes per step).
template <int BITS>
const uint8_t* column_bytes(const uint8_t* src, long row_bytes, uint8_t* dst) {
  if constexpr (BITS == 8) {
    return src;
  } else {
    const __m512i low = _mm512_set1_epi8(0x0f);
    // 128-bit lanes: [lo 0, hi 0, lo 1, hi 1] and [lo 2, hi 2, lo 3, hi 3].
    const __m512i first = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
    const __m512i second = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
    long i = 0;
    for (; i + 64 <= row_bytes; i += 64) {
      const __m512i p = _mm512_loadu_si512(src + i);
      const __m512i lo = _mm512_and_si512(p, low);
      const __m512i hi = _mm512_and_si512(_mm512_srli_epi16(p, 4), low);
      _mm512_storeu_si512(dst + 2 * i, _mm512_permutex2var_epi64(lo, first, hi));
      _mm512_storeu_si512(dst + 2 * i + 64, _mm512_permutex2var_epi64(lo, second, hi));
    }
    const __m128i low16 = _mm_set1_epi8(0x0f);
    for (; i < row_bytes; i += 16) {  // row_bytes is a multiple of 16 (K of 32)
      const __m128i p = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i), _mm_and_si128(p, low16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + 2 * i + 16),
                       _mm_and_si128(_mm_srli_epi16(p, 4), low16));
    }
    return dst;
  }
}

// 16 rows (from m0) x NC columns over all of K; wc[c] points at column c's weights as bytes
// in input order, sb/bb at its scales and biases widened ([c * G + g]).
// RV vectors of 16 rows (from m0) x NC columns (c0.. of the block) over all of K; wc[c]
// points at column c's weights as bytes in Int8Rows' order, sb/bb at its scales and biases
// widened ([c * G + g]). `ahead`/`ahead_lines`: cache lines of the next column block's stored
// weights, fetched a few per 32 inputs while this tile computes (none: nullptr). Each (row,
// column) goes through the same operations in the same order whatever RV and NC are.
template <int RV, int NC>
void vnni_tile(const QmmArgs& a, const Int8Rows& xr, int m0, const uint8_t* const* wc,
               const float* sb, const float* bb, int n0, int n_end, int c0, const char* ahead,
               long ahead_lines) {
  const int G = a.K / a.group_size;
  const int bpg = a.group_size / 32;
  const long blocks = long(G) * bpg;
  long fetched = 0;
  __m512 acc[RV][NC];
#pragma GCC unroll 16
  for (int r = 0; r < RV; ++r)
#pragma GCC unroll 16
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int g = 0; g < G; ++g) {
    for (int b = 0; b < bpg; ++b) {
      const long blk = long(g) * bpg + b;
      if (ahead != nullptr) {
        for (const long until = ahead_lines * (blk + 1) / blocks; fetched < until; ++fetched)
          _mm_prefetch(ahead + fetched * 64, _MM_HINT_T0);
      }
      __m512i ia[RV][NC];
#pragma GCC unroll 16
      for (int r = 0; r < RV; ++r)
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) ia[r][c] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int u = 0; u < 8; ++u) {
        const long kq = blk * 8 + u;  // which 4 inputs
        __m512i xv[RV];
#pragma GCC unroll 4
        for (int r = 0; r < RV; ++r) xv[r] = _mm512_loadu_si512(xr.xq + xq_at(a.K, kq, m0 + 16 * r));
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const __m512i w = _mm512_set1_epi32(load_u32(wc[c0 + c] + kq * 4));
#pragma GCC unroll 4
          for (int r = 0; r < RV; ++r) ia[r][c] = _mm512_dpbusd_epi32(ia[r][c], w, xv[r]);
        }
      }
#pragma GCC unroll 4
      for (int r = 0; r < RV; ++r) {
        const __m512 dv = _mm512_loadu_ps(xr.d + d_at(a.K, blk, m0 + 16 * r));
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c) {
          const __m512 sd = _mm512_mul_ps(dv, _mm512_set1_ps(sb[(c0 + c) * G + g]));
          acc[r][c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r][c]), sd, acc[r][c]);
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RV; ++r) {
      const __m512 sv = _mm512_loadu_ps(xr.sums + sums_at(G, g, m0 + 16 * r));
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c)
        acc[r][c] = _mm512_fmadd_ps(sv, _mm512_set1_ps(bb[(c0 + c) * G + g]), acc[r][c]);
    }
  }
  alignas(64) float lanes[16];
  for (int r = 0; r < RV; ++r) {
    for (int c = 0; c < NC && n0 + c0 + c < n_end; ++c) {
      _mm512_store_ps(lanes, acc[r][c]);
      const int mr = m0 + 16 * r;
      for (int i = 0; i < 16 && mr + i < a.M; ++i) a.out[long(mr + i) * a.N + n0 + c0 + c] = lanes[i];
    }
  }
}

// Columns [n0, n0 + kVnniCols) (columns at or past n_end repeat the last valid one) for every
// row: the block's 4-bit weights unpacked to bytes once, its scales widened once, then tiles
// of 16 rows.
template <int BITS, ScaleType ST>
void vnni_block(const QmmArgs& a, const Int8Rows& xr, int n0, int n_end,
                std::vector<uint8_t>& wbuf, std::vector<float>& sbuf) {
  constexpr int NC = kVnniCols;
  const int K = a.K;
  const int G = K / a.group_size;
  const long row_bytes = long(K) * BITS / 8;
  const uint8_t* wc[NC];
  sbuf.resize(size_t(2) * NC * G);
  float* sb = sbuf.data();
  float* bb = sb + NC * G;
  wbuf.resize(size_t(NC) * K);  // 4-bit columns are unpacked into it
  for (int c = 0; c < NC; ++c) {
    const long col = n0 + c < n_end ? n0 + c : n_end - 1;
    const uint8_t* src = reinterpret_cast<const uint8_t*>(a.w) + col * row_bytes;
    wc[c] = column_bytes<BITS>(src, row_bytes, wbuf.data() + long(c) * K);
    widen<ST>(a.scales, col * G, G, sb + long(c) * G);
    widen<ST>(a.biases, col * G, G, bb + long(c) * G);
  }
  // Two vectors of 16 rows at a time share each weight's broadcast (0.625 loads per
  // vpdpbusd against 1.125 with one vector: the loads, not the multiply-adds, bounded it); the
  // block's unpacked weights (8 x K bytes) stay in L1 across the row tiles. Measured on 1B
  // shapes (both builds in one process, best of 5): 64 rows 552 -> 440 ms, 512 rows 3.80 ->
  // 3.39 s; 4 vectors x 4 columns in two passes was far slower (771 ms), 2 x 4 in between.
  // The next block's weights (stored, contiguous after these) stream in from memory while
  // the first tile computes, rather than stalling the unpacking above on every line: at 16
  // rows the unpacking was ~30 % of the kernel's time, most of it waiting on memory.
  const char* ahead = nullptr;
  long ahead_lines = 0;
  if (n0 + NC < n_end) {
    const long cols = n_end - (n0 + NC) < NC ? n_end - (n0 + NC) : NC;
    ahead = reinterpret_cast<const char*>(a.w) + (n0 + NC) * row_bytes;
    ahead_lines = (cols * row_bytes + 63) / 64;
  }
  int m = 0;
  for (; m + 32 <= xr.Mp; m += 32) {
    vnni_tile<2, NC>(a, xr, m, wc, sb, bb, n0, n_end, 0, ahead, ahead_lines);
    ahead = nullptr;
  }
  for (; m < xr.Mp; m += 16) {
    vnni_tile<1, NC>(a, xr, m, wc, sb, bb, n0, n_end, 0, ahead, ahead_lines);
    ahead = nullptr;
  }
}

template <int BITS, ScaleType ST>
void vnni_typed(const QmmArgs& a, const Int8Rows& xr, int n0, int n1) {
  std::vector<uint8_t> wbuf;
  std::vector<float> sbuf;
  for (int n = n0; n < n1; n += kVnniCols) vnni_block<BITS, ST>(a, xr, n, n1, wbuf, sbuf);
}

// ---- Few rows: the output's columns as lanes ----------------------------------------------
// Below kRowsKernelMin rows a 16-row vector would be mostly padding, so lanes are 16 output
// columns instead: one packed 32-bit word per column (8 inputs at 4 bits, 4 at 8 bits), 16
// columns transposed in registers so that a vector holds the same word of each (cols_tile),
// and each row's 4 activations are one broadcast. Every (row, column) goes through the same float operations in the same order as
// in vnni_tile (d * s per block, then an FMA; the biases' FMA per group), and the int32 block
// sums are exact, so a row gets the same bits from both kernels: with int8 activations a
// row's result never depends on how many rows are beside it.

// r[i] lane j -> r[j] lane i, for 16 vectors of 16 32-bit words.
inline void transpose16(__m512i r[16]) {
  __m512i a[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // b[4G + e], 128-bit lane L: rows 4G..4G+3 of word 4L + e.
  __m512i b[16];
  for (int g = 0; g < 16; g += 4) {
    b[g] = _mm512_unpacklo_epi64(a[g], a[g + 2]);
    b[g + 1] = _mm512_unpackhi_epi64(a[g], a[g + 2]);
    b[g + 2] = _mm512_unpacklo_epi64(a[g + 1], a[g + 3]);
    b[g + 3] = _mm512_unpackhi_epi64(a[g + 1], a[g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i c0 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0x44);
    const __m512i c1 = _mm512_shuffle_i32x4(b[e], b[4 + e], 0xee);
    const __m512i c2 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0x44);
    const __m512i c3 = _mm512_shuffle_i32x4(b[8 + e], b[12 + e], 0xee);
    r[e] = _mm512_shuffle_i32x4(c0, c2, 0x88);
    r[4 + e] = _mm512_shuffle_i32x4(c0, c2, 0xdd);
    r[8 + e] = _mm512_shuffle_i32x4(c1, c3, 0x88);
    r[12 + e] = _mm512_shuffle_i32x4(c1, c3, 0xdd);
  }
}

// MR rows from m0 x 16 columns (packed weights at col[c], scales and biases [G][16] in sv, bv).
// The weights are read as stored: per chunk, one 32-bit word per column (8 inputs at 4 bits,
// 4 at 8 bits) for 16 words, transposed so that a vector holds one word of every column, and
// unpacked in registers. The float operations per (row, column) are vnni_tile's, in its order.
template <int BITS, int MR>
void cols_tile(const QmmArgs& a, const Int8Rows& xr, const int8_t* xc, int m0,
               const uint8_t* const* col, const float* sv, const float* bv, int n0,
               __mmask16 valid) {
  constexpr int kPerWord = 32 / BITS;  // inputs per 32-bit word
  constexpr int kWordsPerBlock = 32 / kPerWord;
  const int K = a.K;
  const int gs = a.group_size;
  __m512 acc[MR];
#pragma GCC unroll 4
  for (int r = 0; r < MR; ++r) acc[r] = _mm512_setzero_ps();
  const __m512i low = _mm512_set1_epi8(0x0f);
  // The next 16 columns (contiguous after these), fetched while these are computed.
  const long next = m0 == 0 && n0 + 32 <= a.N ? 16L * K * BITS / 8 : 0;
  for (long k0 = 0; k0 < K; k0 += 16 * kPerWord) {
    const int words = K - k0 >= 16 * kPerWord ? 16 : int((K - k0) / kPerWord);
    const __mmask16 m = words == 16 ? __mmask16(0xffff) : __mmask16((1u << words) - 1);
    __m512i w[16];
#pragma GCC unroll 16
    for (int c = 0; c < 16; ++c) {
      // The next chunks' lines, 16 streams at once: more than the hardware prefetcher follows.
      _mm_prefetch(reinterpret_cast<const char*>(col[c] + k0 * BITS / 8) + 256, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(col[c] + next + k0 * BITS / 8), _MM_HINT_T0);
      w[c] = _mm512_maskz_loadu_epi32(m, col[c] + k0 * BITS / 8);
    }
    transpose16(w);
#pragma GCC unroll 4
    for (int b = 0; b < 16 / kWordsPerBlock; ++b) {
      if (b * kWordsPerBlock >= words) break;
      const long blk = k0 / 32 + b;
      __m512i ia[MR];
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) ia[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
      for (int j = b * kWordsPerBlock; j < (b + 1) * kWordsPerBlock; ++j) {
        const long kx = k0 + long(j) * kPerWord;
        if constexpr (BITS == 4) {
          const __m512i lo = _mm512_and_si512(w[j], low);
          const __m512i hi = _mm512_and_si512(_mm512_srli_epi32(w[j], 4), low);
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const uint8_t* xrow = reinterpret_cast<const uint8_t*>(xc) + long(m0 + r) * K + kx;
            ia[r] = _mm512_dpbusd_epi32(ia[r], lo, _mm512_set1_epi32(load_u32(xrow)));
            ia[r] = _mm512_dpbusd_epi32(ia[r], hi, _mm512_set1_epi32(load_u32(xrow + 4)));
          }
        } else {
#pragma GCC unroll 4
          for (int r = 0; r < MR; ++r) {
            const uint8_t* xrow = reinterpret_cast<const uint8_t*>(xc) + long(m0 + r) * K + kx;
            ia[r] = _mm512_dpbusd_epi32(ia[r], w[j], _mm512_set1_epi32(load_u32(xrow)));
          }
        }
      }
      const long g = blk * 32 / gs;
      const __m512 s = _mm512_loadu_ps(sv + 16 * g);
#pragma GCC unroll 4
      for (int r = 0; r < MR; ++r) {
        const __m512 sd = _mm512_mul_ps(_mm512_set1_ps(xr.d[d_at(K, blk, m0 + r)]), s);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[r]), sd, acc[r]);
      }
      if ((blk + 1) * 32 % gs == 0) {  // the group's last block: its biases
        const __m512 bias = _mm512_loadu_ps(bv + 16 * g);
#pragma GCC unroll 4
        for (int r = 0; r < MR; ++r)
          acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(xr.sums[sums_at(K / gs, g, m0 + r)]), bias,
                                   acc[r]);
      }
    }
  }
  for (int r = 0; r < MR; ++r)
    _mm512_mask_storeu_ps(a.out + long(m0 + r) * a.N + n0, valid, acc[r]);
}

// 16 scales or biases of one column from group g0 (fewer at the end: zeros), as float32.
template <ScaleType ST>
inline __m512i widen16(const void* src, long offset, int count) {
  const __mmask16 m = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
  if constexpr (ST == ScaleType::f32) {
    return _mm512_castps_si512(_mm512_maskz_loadu_ps(m, static_cast<const float*>(src) + offset));
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(m, static_cast<const uint16_t*>(src) + offset);
    if constexpr (ST == ScaleType::f16) return _mm512_castps_si512(_mm512_cvtph_ps(h));
    return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
  }
}

template <int BITS, ScaleType ST>
void cols_typed(const QmmArgs& a, const Int8Rows& xr, int n0, int n1) {
  const int K = a.K;
  const int G = K / a.group_size;
  const long row_bytes = long(K) * BITS / 8;
  // Per thread and reused: a decode step makes ~200 of these calls, each split in tasks.
  thread_local std::vector<float> sv, bv;
  sv.resize(size_t(16) * G);
  bv.resize(size_t(16) * G);
  for (int n = n0; n < n1; n += 16) {
    const uint8_t* col[16];
    long cn[16];
    for (int c = 0; c < 16; ++c) {
      cn[c] = n + c < n1 ? n + c : n1 - 1;
      col[c] = reinterpret_cast<const uint8_t*>(a.w) + cn[c] * row_bytes;
    }
    // [16 columns][G] -> [G][16 columns], 16 groups a pass: each column's 16 scales widened
    // in a register and transposed there (one scalar load and conversion per scale and
    // column cost more than the weights themselves at 1 row).
    for (const auto& [from, to] : {std::pair{a.scales, sv.data()}, std::pair{a.biases, bv.data()}}) {
      for (int g0 = 0; g0 < G; g0 += 16) {
        __m512i r[16];
        for (int c = 0; c < 16; ++c) r[c] = widen16<ST>(from, cn[c] * G + g0, G - g0);
        transpose16(r);
        for (int u = 0; u < 16 && g0 + u < G; ++u)
          _mm512_storeu_si512(to + 16L * (g0 + u), r[u]);
      }
    }
    const __mmask16 valid = n1 - n >= 16 ? __mmask16(0xffff) : __mmask16((1u << (n1 - n)) - 1);
    const int8_t* xc = xr.xc;
    for (int m = 0; m < a.M;) {
      const int rows = a.M - m >= 4 ? 4 : a.M - m;
      switch (rows) {
        case 1: cols_tile<BITS, 1>(a, xr, xc, m, col, sv.data(), bv.data(), n, valid); break;
        case 2: cols_tile<BITS, 2>(a, xr, xc, m, col, sv.data(), bv.data(), n, valid); break;
        case 3: cols_tile<BITS, 3>(a, xr, xc, m, col, sv.data(), bv.data(), n, valid); break;
        default: cols_tile<BITS, 4>(a, xr, xc, m, col, sv.data(), bv.data(), n, valid); break;
      }
      m += rows;
    }
  }
}

// `rows`: qmm_rows_vnni's kernel, else qmm_cols_vnni's.
template <int BITS, ScaleType ST>
void vnni_kernel(const QmmArgs& a, const Int8Rows& xr, int n0, int n1, bool rows) {
  if (rows) return vnni_typed<BITS, ST>(a, xr, n0, n1);
  cols_typed<BITS, ST>(a, xr, n0, n1);
}

template <int BITS>
void vnni_bits(const QmmArgs& a, const Int8Rows& xr, int n0, int n1, bool rows) {
  switch (a.scale_type) {
    case ScaleType::f32: return vnni_kernel<BITS, ScaleType::f32>(a, xr, n0, n1, rows);
    case ScaleType::f16: return vnni_kernel<BITS, ScaleType::f16>(a, xr, n0, n1, rows);
    case ScaleType::bf16: return vnni_kernel<BITS, ScaleType::bf16>(a, xr, n0, n1, rows);
  }
}

// ---- K-quant weights -------------------------------------------------------------------------
// Per sub-block of F::kSub inputs the stored codes u (unsigned: Q6_K's 0..63, Q4_K's nibbles)
// meet the int8 activations in vpdpbusd, and a format's code offset (Q6_K's 32) comes off as
// kOffset * sum(xq) over the same inputs (one more vpdpbusd per 4 inputs, against ones, shared
// by every column): sum((u - offset) * xq) exact in int32, then one FMA with the row block's d
// times the sub-block's scale. A format's mins (Q4_K: a sub-block is exactly one 32-input
// block of xr) add m * d * sum(xq), the sums qmm_quantize_rows_int8 keeps per 32 inputs, as
// llama.cpp's Q8_K sums serve its Q4_K dot product. 16 rows x NC columns; wb: the NC columns'
// codes as bytes [NC][K], sb and mb: their scales and mins per 16 inputs [NC][K / 16].
template <class F, int NC>
void kq_vnni_tile(const KQuantArgs& a, const Int8Rows& xr, int m0, const uint8_t* wb,
                  const float* sb, const float* mb, int n0, int n_end) {
  constexpr int U = F::kSub / 4;  // vpdpbusd steps (4 inputs each) per sub-block
  const int K = a.K;
  const __m512i ones = _mm512_set1_epi8(1);
  __m512 acc[NC];
#pragma GCC unroll 16
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (long blk = 0; blk < K / 32; ++blk) {
    const __m512 dv = _mm512_loadu_ps(xr.d + d_at(K, blk, m0));
    for (int h = 0; h < 32 / F::kSub; ++h) {
      __m512i xv[U];
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u)
        xv[u] = _mm512_loadu_si512(xr.xq + xq_at(K, blk * 8 + h * U + u, m0));
      // -offset x the sub-block's activation sum as every column's starting point.
      __m512i start = _mm512_setzero_si512();
      if constexpr (F::kOffset != 0) {
        __m512i xs = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int u = 0; u < U; ++u) xs = _mm512_dpbusd_epi32(xs, ones, xv[u]);
        start = _mm512_sub_epi32(start, _mm512_mullo_epi32(xs, _mm512_set1_epi32(F::kOffset)));
      }
      __m512i ia[NC];
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) ia[c] = start;
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const long kq = blk * 8 + h * U + u;  // which 4 inputs
#pragma GCC unroll 16
        for (int c = 0; c < NC; ++c)
          ia[c] = _mm512_dpbusd_epi32(ia[c], _mm512_set1_epi32(load_u32(wb + long(c) * K + kq * 4)),
                                      xv[u]);
      }
      const long j = (blk * 32 + h * F::kSub) / 16;  // the sub-block's first 16 inputs
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c) {
        const __m512 sd = _mm512_mul_ps(dv, _mm512_set1_ps(sb[long(c) * (K / 16) + j]));
        acc[c] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(ia[c]), sd, acc[c]);
      }
    }
    if constexpr (F::kMins) {
      const __m512 sv = _mm512_loadu_ps(xr.sums + sums_at(K / 32, blk, m0));
#pragma GCC unroll 16
      for (int c = 0; c < NC; ++c)
        acc[c] = _mm512_fmadd_ps(sv, _mm512_set1_ps(mb[long(c) * (K / 16) + blk * 2]), acc[c]);
    }
  }
  alignas(64) float lanes[16];
  for (int c = 0; c < NC && n0 + c < n_end; ++c) {
    _mm512_store_ps(lanes, acc[c]);
    for (int i = 0; i < 16 && m0 + i < a.M; ++i) a.out[long(m0 + i) * a.N + n0 + c] = lanes[i];
  }
}

}  // namespace

void qmm_quantize_rows_int8(const float* x, int M, int K, int group_size, Int8Rows& xr) {
  alignas(64) int8_t order[32];  // the block's inputs as stored in xq (or xc)
  for (int j = 0; j < 32; ++j) {
    if (xr.xc != nullptr) {  // qmm_cols_vnni's order: per 8 at 4 bits, the evens then the odds
      const int e = j % 8;
      order[j] = int8_t(xr.cols_bits == 4 ? j - e + (e < 4 ? 2 * e : 2 * (e - 4) + 1) : j);
    } else {
      order[j] = int8_t(xr.nibbles ? (j < 16 ? 2 * j : 2 * (j - 16) + 1) : j);
    }
  }
  const int Mp = xr.Mp;
  const long blocks = K / 32;
  const int bpg = group_size / 32;
  if (Mp > M) {
    if (xr.xc == nullptr) std::memset(xr.xq, 0, size_t(Mp) * K);
    std::memset(xr.d, 0, sizeof(float) * size_t(Mp) * blocks);
    std::memset(xr.sums, 0, sizeof(float) * size_t(Mp) * (K / group_size));
  }
  const __m512 sign = _mm512_set1_ps(-0.0f);
  alignas(64) int8_t q[32];
  for (int m = 0; m < M; ++m) {
    const float* row = x + long(m) * K;
    float group_sum = 0.0f;
    for (long blk = 0; blk < blocks; ++blk) {
      const __m512 x0 = _mm512_loadu_ps(row + blk * 32);
      const __m512 x1 = _mm512_loadu_ps(row + blk * 32 + 16);
      const float amax = _mm512_reduce_max_ps(
          _mm512_max_ps(_mm512_andnot_ps(sign, x0), _mm512_andnot_ps(sign, x1)));
      const float d = amax / 127.0f;
      const __m512 inv = _mm512_set1_ps(amax > 0.0f ? 127.0f / amax : 0.0f);
      // Round to nearest (even); the saturating narrowing only clips a rounding to 127.5.
      _mm_store_si128(reinterpret_cast<__m128i*>(q),
                      _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x0, inv))));
      _mm_store_si128(reinterpret_cast<__m128i*>(q + 16),
                      _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(_mm512_mul_ps(x1, inv))));
      alignas(64) int8_t stored[32];
      for (int j = 0; j < 32; ++j) stored[j] = q[order[j]];
      if (xr.xc != nullptr) {
        std::memcpy(xr.xc + long(m) * K + blk * 32, stored, 32);
      } else {
        for (int u = 0; u < 8; ++u)
          std::memcpy(xr.xq + xq_at(K, blk * 8 + u, m), stored + 4 * u, 4);
      }
      xr.d[d_at(K, blk, m)] = d;
      // The biases multiply the quantised x's sum, not x's own: the weights' offset from
      // zero (q is 0..15 for 4 bits, its mean far from 0) then meets the same x as the scale
      // term and the rounding errors cancel in it, as llama.cpp's Q8_1 keeps d * sum(xq).
      const __m512i qs = _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q)));
      const __m512i qs1 =
          _mm512_cvtepi8_epi32(_mm_load_si128(reinterpret_cast<const __m128i*>(q + 16)));
      group_sum += d * float(_mm512_reduce_add_epi32(_mm512_add_epi32(qs, qs1)));
      if ((blk + 1) % bpg == 0) {
        xr.sums[sums_at(K / group_size, blk / bpg, m)] = group_sum;
        group_sum = 0.0f;
      }
    }
  }
}

void qmm_rows_vnni(const QmmArgs& a, const Int8Rows& xr, int n0, int n1) {
  if (a.bits == 4) return vnni_bits<4>(a, xr, n0, n1, true);
  return vnni_bits<8>(a, xr, n0, n1, true);
}

}  // namespace mlxcel_native

namespace mlxcel_native {

void qmm_cols_vnni(const QmmArgs& a, const Int8Rows& xr, int n0, int n1) {
  if (a.bits == 4) return vnni_bits<4>(a, xr, n0, n1, false);
  return vnni_bits<8>(a, xr, n0, n1, false);
}

void kq_rows_vnni(const KQuantArgs& a, const Int8Rows& xr, int n0, int n1) {
  constexpr int NC = kVnniCols;
  const int K = a.K;
  // Per thread and reused: the column block's codes, scales and mins, decoded once for every
  // row tile.
  thread_local std::vector<uint8_t> wb;
  thread_local std::vector<float> sb, mb;
  wb.resize(size_t(NC) * K);
  sb.resize(size_t(NC) * (K / 16));
  mb.resize(size_t(NC) * (K / 16));
  with_format(a.format, [&]<class F>() {
    const long row_bytes = long(K) / 256 * F::kBytes;
    for (int n = n0; n < n1; n += NC) {
      for (int c = 0; c < NC; ++c) {
        const long col = n + c < n1 ? n + c : n1 - 1;
        for (long b = 0; b < K / 256; ++b)
          F::template decode<false>(a.w + col * row_bytes + b * F::kBytes,
                                    reinterpret_cast<int8_t*>(wb.data() + long(c) * K + b * 256),
                                    sb.data() + long(c) * (K / 16) + b * 16,
                                    mb.data() + long(c) * (K / 16) + b * 16);
      }
      for (int m = 0; m < xr.Mp; m += 16)
        kq_vnni_tile<F, NC>(a, xr, m, wb.data(), sb.data(), mb.data(), n, n1);
    }
  });
}

}  // namespace mlxcel_native
