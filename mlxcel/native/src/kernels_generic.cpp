// Portable kernels for x86-64 CPUs without AVX-512 (and any other target): each output
// column's weights are dequantised once into a float buffer, then dotted with every row. Not
// fast, but correct everywhere; the Python side prefers mlx's own ops when this is all there is.
#include <cstring>
#include <vector>

#include "kernels.h"
#include "kquant_scales.h"

namespace mlxcel_native {
namespace {

float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1f;
  uint32_t man = h & 0x3ff;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000 | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {
    // Subnormal half: normalise the mantissa.
    exp = 113;
    while (!(man & 0x400)) {
      man <<= 1;
      --exp;
    }
    bits = sign | (exp << 23) | ((man & 0x3ff) << 13);
  }
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

float bf16_to_float(uint16_t h) {
  const uint32_t bits = uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

float load_scale(const void* p, ScaleType t, long i) {
  switch (t) {
    case ScaleType::f16: return half_to_float(static_cast<const uint16_t*>(p)[i]);
    case ScaleType::bf16: return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
    default: return static_cast<const float*>(p)[i];
  }
}

// Eight partial sums keep the loop vectorisable without -ffast-math.
float dot(const float* a, const float* b, int K) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int k = 0;
  for (; k + 8 <= K; k += 8)
    for (int j = 0; j < 8; ++j) s[j] += a[k + j] * b[k + j];
  for (; k < K; ++k) s[0] += a[k] * b[k];
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace

void qmm_generic(const QmmArgs& a, int n0, int n1) {
  const int K = a.K;
  const long G = K / a.group_size;
  const int per_word = 32 / a.bits;
  const uint32_t mask = (1u << a.bits) - 1;
  std::vector<float> w(K);
  for (long n = n0; n < n1; ++n) {
    const uint32_t* wr = a.w + n * (K / per_word);
    for (long g = 0; g < G; ++g) {
      const float s = load_scale(a.scales, a.scale_type, n * G + g);
      const float b = load_scale(a.biases, a.scale_type, n * G + g);
      for (int k = int(g) * a.group_size; k < (g + 1) * a.group_size; ++k) {
        const uint32_t q = (wr[k / per_word] >> ((k % per_word) * a.bits)) & mask;
        w[k] = s * float(q) + b;
      }
    }
    for (int m = 0; m < a.M; ++m) a.out[long(m) * a.N + n] = dot(a.x + long(m) * K, w.data(), K);
  }
}

void bf16mm_generic(const Bf16Args& a, int n0, int n1) {
  const int K = a.K;
  std::vector<float> w(K);
  for (long n = n0; n < n1; ++n) {
    for (int k = 0; k < K; ++k) w[k] = bf16_to_float(a.w[n * K + k]);
    for (int m = 0; m < a.M; ++m) a.out[long(m) * a.N + n] = dot(a.x + long(m) * K, w.data(), K);
  }
}

namespace {

// One block's 256 weights as float32, portable C++ (the layouts: kquant_block.h).
void kq_block_weights(KQuant format, const uint8_t* b, float* w) {
  if (format == KQuant::q4_k) {
    const float d = half_to_float(uint16_t(b[0] | (b[1] << 8)));
    const float dmin = half_to_float(uint16_t(b[2] | (b[3] << 8)));
    const uint8_t* sc = b + 4;
    for (int j = 0; j < 8; ++j) {
      int scale, mn;
      q4k_scale_min(sc, j, scale, mn);
      const float s = d * float(scale), m = dmin * float(mn);
      for (int l = 0; l < 32; ++l) {
        const uint8_t byte = b[16 + 32 * (j / 2) + l];
        w[32 * j + l] = s * float(j % 2 == 0 ? byte & 15 : byte >> 4) - m;
      }
    }
    return;
  }
  const float d = half_to_float(uint16_t(b[208] | (b[209] << 8)));
  for (int i = 0; i < 256; ++i) {
    const int h = i / 128, quarter = (i % 128) / 32, l = i % 32;
    const uint8_t ql = b[64 * h + l + 32 * (quarter & 1)];
    const int low = quarter < 2 ? ql & 15 : ql >> 4;
    const int high = (b[128 + 32 * h + l] >> (2 * quarter)) & 3;
    w[i] = d * float(int8_t(b[192 + i / 16])) * float((low | (high << 4)) - 32);
  }
}

}  // namespace

void kq_generic(const KQuantArgs& a, int n0, int n1) {
  const int K = a.K;
  const int bytes = kquant_block_bytes(a.format);
  const long row_bytes = long(K) / 256 * bytes;
  std::vector<float> w(K);
  for (long n = n0; n < n1; ++n) {
    for (int k0 = 0; k0 < K; k0 += 256)
      kq_block_weights(a.format, a.w + n * row_bytes + k0 / 256 * bytes, w.data() + k0);
    for (int m = 0; m < a.M; ++m) a.out[long(m) * a.N + n] = dot(a.x + long(m) * K, w.data(), K);
  }
}

void qmm_prepare_x(const float* x, float* xp, int M, int K) {
  for (long m = 0; m < M; ++m) {
    const float* src = x + m * K;
    float* dst = xp + m * K;
    for (int k = 0; k < K; k += 32) {
      for (int j = 0; j < 16; ++j) {
        dst[k + j] = src[k + 2 * j];
        dst[k + 16 + j] = src[k + 2 * j + 1];
      }
    }
  }
}

void qmm_transpose_x(const float* x, float* xT, int M, int Mp, int K, bool nibble_order) {
  for (int k = 0; k < K; ++k) {
    // Position k of the (reordered) chunk reads input src of x.
    const int j = k % 32;
    const int src = nibble_order ? k - j + (j < 16 ? 2 * j : 2 * (j - 16) + 1) : k;
    float* dst = xT + long(k) * Mp;
    for (int m = 0; m < M; ++m) dst[m] = x[long(m) * K + src];
    for (int m = M; m < Mp; ++m) dst[m] = 0.0f;
  }
}

}  // namespace mlxcel_native
