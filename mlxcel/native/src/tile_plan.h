// What a quantised matmul's register tile reads, apart from its vector work: its columns' packed
// weights and the software prefetch of the tile kPrefetchTiles ahead. For the AVX-512 and AVX2
// kernels' translation units; internal linkage in each, so no copy is shared between them.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

namespace mlxcel_native {
namespace {

constexpr int kPrefetchTiles = 2;

// Columns [n0, n0 + NC): col[c] and its packed weights wcol[c]; columns at or past n_end repeat
// the last valid column (their sums are discarded), so a ragged last tile needs no kernel of
// its own.
template <int BITS, int NC>
void tile_columns(const QmmArgs& a, int n0, int n_end, long* col, const uint8_t** wcol) {
  const long row_bytes = long(a.K) * BITS / 8;
  for (int c = 0; c < NC; ++c) {
    col[c] = n0 + c < n_end ? n0 + c : n_end - 1;
    wcol[c] = reinterpret_cast<const uint8_t*>(a.w) + col[c] * row_bytes;
  }
}

// Software prefetch of the tile kPrefetchTiles ahead (columns are contiguous in memory), its
// scales and biases at once, its weights spread over this tile's 32-input chunks (chunk()): at
// one row the tile's arithmetic is short, and without it the next weights' memory latency is
// not overlapped with it (measured: 1536x576 at 1 row, 40 us cached vs 80 us streamed).
template <int BITS, int NC, ScaleType ST>
struct TilePrefetch {
  const char* w = nullptr;
  long lines = 0;  // none when there is no tile that far ahead
  long per_chunk = 0;
  long next = 0;

  TilePrefetch(const QmmArgs& a, int n0) {
    const long col = long(n0) + long(kPrefetchTiles) * NC;
    if (col + NC > a.N) return;
    const long row_bytes = long(a.K) * BITS / 8;
    const long G = a.K / a.group_size;
    w = reinterpret_cast<const char*>(a.w) + col * row_bytes;
    lines = NC * row_bytes / 64;
    per_chunk = (lines + a.K / 32 - 1) / (a.K / 32);
    const long scale_bytes = NC * G * (ST == ScaleType::f32 ? 4 : 2);
    const long offset = col * G * (ST == ScaleType::f32 ? 4 : 2);
    for (long b = 0; b < scale_bytes; b += 64) {
      _mm_prefetch(static_cast<const char*>(a.scales) + offset + b, _MM_HINT_T0);
      _mm_prefetch(static_cast<const char*>(a.biases) + offset + b, _MM_HINT_T0);
    }
  }

  void chunk() {
    for (long i = 0; i < per_chunk && next < lines; ++i, ++next)
      _mm_prefetch(w + next * 64, _MM_HINT_T0);
  }
};

}  // namespace
}  // namespace mlxcel_native
