// Q4_K's packed 6-bit sub-block scales and mins (llama.cpp's get_scale_min_k4), for the
// portable kernel and kquant_block.h alike; internal linkage in each translation unit, as
// tile_plan.h, so no copy compiled with AVX-512 is shared with code built without it.
#pragma once

#include <cstdint>

namespace mlxcel_native {
namespace {

// Sub-block j (0..7) of the 12 bytes at `sc`: bytes 0-3 hold scales 0-3 in their low 6 bits
// (the top 2: scales 4-7's high bits), bytes 4-7 the same for the mins, bytes 8-11 scales
// 4-7's low nibbles and mins 4-7's.
inline void q4k_scale_min(const uint8_t* sc, int j, int& scale, int& mn) {
  scale = j < 4 ? sc[j] & 63 : (sc[j + 4] & 15) | ((sc[j - 4] >> 6) << 4);
  mn = j < 4 ? sc[j + 4] & 63 : (sc[j + 4] >> 4) | ((sc[j] >> 6) << 4);
}

}  // namespace
}  // namespace mlxcel_native
