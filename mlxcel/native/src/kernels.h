// The kernels' interface: plain structs and functions, no mlx types, so that the AVX-512 and
// AVX2 translation units can be compiled with -mavx512* / -mavx2 without sharing any inline
// (ODR-merged) code with the rest of the extension or with each other; a merged copy could run
// AVX-512 code on a CPU without it. ops.cpp picks the instruction set at run time (kernel_isa).
#pragma once

#include <cstdint>

namespace mlxcel_native {

enum class ScaleType : int { f32 = 0, f16 = 1, bf16 = 2 };

// out[M, N] = x[M, K] @ dequantize(w, scales, biases).T, mlx's affine layout: w is uint32
// [N, K * bits / 32] (value j of a word in bits [j*bits, (j+1)*bits)), scales and biases
// [N, K / group_size], weight = scale * q + bias.
struct QmmArgs {
  const float* x;  // [M, K] row-major; for the AVX-512 4-bit kernel as qmm_prepare_x left it
  const uint32_t* w;
  const void* scales;
  const void* biases;
  ScaleType scale_type;
  int group_size;  // 32, 64 or 128
  int bits;  // 4 or 8
  int M, N, K;
  float* out;  // [M, N] row-major
};

// out[M, N] = x[M, K] @ w.T for w bfloat16 [N, K] (raw uint16 bits).
struct Bf16Args {
  const float* x;
  const uint16_t* w;
  int M, N, K;
  float* out;
};

// Each computes output columns [n0, n1) for all rows; callers split N over threads.
void qmm_avx512(const QmmArgs& a, int n0, int n1);
void bf16mm_avx512(const Bf16Args& a, int n0, int n1);
void qmm_avx2(const QmmArgs& a, int n0, int n1);
void bf16mm_avx2(const Bf16Args& a, int n0, int n1);
void qmm_generic(const QmmArgs& a, int n0, int n1);
void bf16mm_generic(const Bf16Args& a, int n0, int n1);

// The AVX-512 and AVX2 4-bit kernels read activations reordered per 32-element chunk: the 16 even
// elements, then the 16 odd ones (the order in which it unpacks low and high nibbles).
void qmm_prepare_x(const float* x, float* xp, int M, int K);

// Column-tile width the AVX-512 / AVX2 kernels use at M rows: thread ranges are cut at multiples.
int avx512_tile_cols(int M);
int avx2_tile_cols(int M);

// From this many rows on, quantized and bfloat16 matmuls take the rows kernel: x transposed by
// qmm_transpose_x, then qmm_rows_avx512 or qmm_rows_avx2 (see kernels_avx512.cpp for why).
constexpr int kRowsKernelMin = 12;
// xT [K, Mp] = x [M, K] transposed (Mp: M rounded up to 16), rows M..Mp zero; `nibble_order`: each 32-element chunk of
// K in qmm_prepare_x's order (4-bit).
void qmm_transpose_x(const float* x, float* xT, int M, int Mp, int K, bool nibble_order);
void qmm_rows_avx512(const QmmArgs& a, const float* xT, int Mp, int n0, int n1);
void bf16mm_rows_avx512(const Bf16Args& a, const float* xT, int Mp, int n0, int n1);
void qmm_rows_avx2(const QmmArgs& a, const float* xT, int Mp, int n0, int n1);
void bf16mm_rows_avx2(const Bf16Args& a, const float* xT, int Mp, int n0, int n1);

// ---- K-quant weights as GGUF stores them (kq_*; the block layouts in kquant_block.h) ------
// out[M, N] = x[M, K] @ W.T for W [N, K] held as llama.cpp's blocks of one K-quant format,
// each row K / 256 blocks of kquant_block_bytes(format) (K a multiple of 256), computed in
// float32 from exactly the weights llama.cpp dequantises. One path for every format: the
// kernels are templated on the format's decoder, so a new format is a decoder and a trait.
enum class KQuant : int { q4_k = 0, q6_k = 1 };
constexpr int kQ4kBlockBytes = 144;
constexpr int kQ6kBlockBytes = 210;
constexpr int kquant_block_bytes(KQuant format) {
  return format == KQuant::q4_k ? kQ4kBlockBytes : kQ6kBlockBytes;
}
struct KQuantArgs {
  const float* x;  // [M, K] row-major
  const uint8_t* w;  // [N, K / 256 * kquant_block_bytes(format)]
  int M, N, K;
  float* out;  // [M, N] row-major
  KQuant format;
};
// Columns [n0, n1) for every row; below kRowsKernelMin rows register tiles (callers cut
// ranges at avx512_tile_cols / avx2_tile_cols), from it on the rows kernel over xT as
// qmm_transpose_x leaves it (natural order).
void kq_avx512(const KQuantArgs& a, int n0, int n1);
void kq_rows_avx512(const KQuantArgs& a, const float* xT, int Mp, int n0, int n1);
void kq_avx2(const KQuantArgs& a, int n0, int n1);
void kq_rows_avx2(const KQuantArgs& a, const float* xT, int Mp, int n0, int n1);
void kq_generic(const KQuantArgs& a, int n0, int n1);

// ---- int8 activations (AVX512-VNNI, kernels_vnni.cpp) ------------------------------------
// Rows quantised per 32-input block, tile-major (16 rows a tile): xq [Mp/16][K/4][16][4] int8
// (4 inputs of 16 rows per 64 bytes), d [Mp/16][K/32][16] (each block's scale, max|x| / 127),
// sums [Mp/16][K/group_size][16] (each weight group's sum of the quantised x, d * sum(xq) over
// its blocks, for the biases). Rows M..Mp are zero. Only kernels_vnni.cpp reads or writes them.
// `nibbles`: within each 32-input block, the even inputs come first, then the odd ones (the
// order in which 4-bit weights unpack fastest: qmm_rows_vnni with 4 bits wants it, the
// columns kernel does not). A block's integer dot product is exact in any order, so the
// results are the same bits either way.
struct Int8Rows {
  int8_t* xq;
  float* d;
  float* sums;
  int Mp;  // rows rounded up to 16
  bool nibbles = false;
  // For the columns kernel (fewer than kRowsKernelMin rows): when set, the quantiser writes
  // each row's int8 x here instead of xq, row-major [M][K], in the order qmm_cols_vnni reads
  // it for `cols_bits`-bit weights (per 8 inputs the even ones then the odd ones at 4 bits).
  int8_t* xc = nullptr;
  int cols_bits = 0;
};
void qmm_quantize_rows_int8(const float* x, int M, int K, int group_size, Int8Rows& xr);
// Columns [n0, n1) of out for every row; callers cut column ranges at multiples of kVnniCols.
void qmm_rows_vnni(const QmmArgs& a, const Int8Rows& xr, int n0, int n1);
constexpr int kVnniCols = 8;
// The same below kRowsKernelMin rows (columns as lanes; ranges cut at multiples of 16), giving
// each row the bits qmm_rows_vnni gives it.
void qmm_cols_vnni(const QmmArgs& a, const Int8Rows& xr, int n0, int n1);
constexpr int kVnniColsSmall = 16;
// K-quant weights (KQuantArgs) against xr as qmm_quantize_rows_int8 left it at group_size 32
// (xq, no nibble order; sums per 32 inputs for the formats' mins), at any row count (lanes are
// 16 rows); ranges cut at multiples of kVnniCols. A row's result depends only on that row.
void kq_rows_vnni(const KQuantArgs& a, const Int8Rows& xr, int n0, int n1);

// ---- attention (attention_avx512.cpp, attention_avx2.cpp) ----------------------------------
// out[b, h, i] = softmax(scale * q[b, h, i] k^T [+ mask]) v over the keys query i may see, for
// q [B, H, Lq, D], k [B, KVH, S, D], v [B, KVH, S, Dv] (H a multiple of KVH, each KV head
// serving H / KVH query heads), every last axis contiguous. `causal`: query i sees keys up to
// S - Lq + i (the queries are the last Lq positions). Strides are in elements; a mask is bool
// (keep) or additive float32, broadcast by stride 0. Keys the mask drops are skipped, not
// weighted by zero, so a row's result does not depend on the padding that other rows'
// lengths give a batch.
struct AttnArgs {
  const float* q;
  int64_t q_sb, q_sh, q_sl;
  const float* k;
  int64_t k_sb, k_sh, k_ss;
  const float* v;
  int64_t v_sb, v_sh, v_ss;
  const uint8_t* keep;  // bool mask or nullptr
  const float* add;  // additive mask or nullptr
  int64_t m_sb, m_sh, m_sl, m_ss;
  int B, H, Lq, KVH, S, D, Dv;
  bool causal;
  float scale;
  float* out;  // [B, H, Lq, Dv] row-major
  // Set by attention_grouped: the H / KVH query heads of a KV head are computed together
  // (each key and value read once for all of them), and the kernels' ranges count units
  // (b * KVH + g) * Lq + i, each the rows of heads g * H / KVH .. (g + 1) * H / KVH - 1.
  bool grouped = false;
};
// Whether the kernels take `a` a KV head's query heads at a time: when several heads share
// a KV head, the keys are scored one query row at a time (few query rows: decode), and the
// mask is the same for every head.
bool attention_grouped(const AttnArgs& a);
// Whether attend_rows scores the keys in transposed blocks (many query rows per KV head).
bool attention_blocked(const AttnArgs& a);
// Computes query rows [r0, r1), row index (b * H + h) * Lq + i (units when a.grouped).
void attention_avx512(const AttnArgs& a, int64_t r0, int64_t r1);
void attention_avx2(const AttnArgs& a, int64_t r0, int64_t r1);

// out[i] = gate[i] * sigmoid(gate[i]) * x[i] for i in [i0, i1) (SwiGLU; elementwise_*.cpp).
void silu_mul_avx512(const float* gate, const float* x, float* out, int64_t i0, int64_t i1);
void silu_mul_avx2(const float* gate, const float* x, float* out, int64_t i0, int64_t i1);

}  // namespace mlxcel_native
