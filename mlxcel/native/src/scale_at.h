// One scale or bias as float32, from its stored type, for the translation units built with
// F16C (the AVX-512 and AVX2 ones); internal linkage in each, so no copy is shared between
// them or with code built without it.
#pragma once

#include <immintrin.h>

#include <cstdint>

#include "kernels.h"

namespace mlxcel_native {
namespace {

template <ScaleType ST>
inline float scale_at(const void* p, long i) {
  if constexpr (ST == ScaleType::f32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (ST == ScaleType::f16) {
    return _cvtsh_ss(static_cast<const uint16_t*>(p)[i]);
  } else {
    const uint32_t bits = uint32_t(static_cast<const uint16_t*>(p)[i]) << 16;
    return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(int(bits))));
  }
}

}  // namespace
}  // namespace mlxcel_native
