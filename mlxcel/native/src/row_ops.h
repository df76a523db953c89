// Row-wise float32 ops for the CPU: RMSNorm, RoPE and decode attention as one graph node each.
//
// mlx has no CPU kernels for mx.fast.rms_norm, mx.fast.rope and
// mx.fast.scaled_dot_product_attention: on the CPU stream they build their fallback graphs,
// ~11, ~29 and ~10 nodes (square, sum, rsqrt, broadcasts; arange, exp, cos, sin, slices,
// concatenate; scale, reshapes, matmul, softmax, matmul). A decode step of a 30-layer model evaluates ~4,400 nodes, ~150 a
// layer, each costing a few microseconds of encoding and dispatch at one row, where the work
// inside is a few hundred floats. These compute what the fallbacks compute (same formulas, in
// float32, in the same order of operations; sums grouped differently, so the last bits may
// differ) and give every row the same bits whatever rows are beside it.
#pragma once

#include <optional>

#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "ops.h"

namespace mx = mlx::core;

namespace mlxcel_native {

// The start of every eval_cpu here: out's buffer allocated, the stream's encoder told the
// inputs and the output; returns the encoder to dispatch the kernel on.
mx::cpu::CommandEncoder& begin_eval(const std::vector<mx::array>& inputs, mx::array& out,
                                    mx::Stream stream);

// x's float32 data as dense rows, for a kernel dispatched next on x's stream: x's own pointer
// when it is row-contiguous, else a copy made by a task dispatched now (kept alive by the
// encoder). Lets the ops take inputs without a Contiguous node ahead of them: at graph build
// an input's layout is not known yet, and a node per input costs more than the rare copy.
const float* dense_rows(const mx::array& x, mx::Stream stream);

// mx.fast.rms_norm(x, w, eps) for float32 x [..., D] and w [D]: x * rsqrt(mean(x^2) + eps) * w.
mx::array rms_norm(const mx::array& x, const mx::array& w, float eps, mx::StreamOrDevice s = {});

// mx.fast.rope(x, dims, traditional, base, scale, offset, freqs) for float32 x [B, ..., L, D]
// (3 or more dimensions; any strides), an int32 offset (scalar or one per batch entry) and
// optional float32 freqs [dims / 2] (periods: 1 / freqs replaces base's inverse frequencies).
mx::array rope(
    const mx::array& x,
    int dims,
    bool traditional,
    float base,
    float scale,
    const mx::array& offset,
    const std::optional<mx::array>& freqs,
    mx::StreamOrDevice s = {});

// mx.fast.scaled_dot_product_attention: float32 q [B, H, Lq, D], k [B, KVH, S, D],
// v [B, KVH, S, Dv] (S >= Lq), `causal` (bottom-right aligned, as mlx's) and/or a mask
// broadcastable to [B, H, Lq, S] (bool: keep; float32: added, -inf drops the key). Keys a mask
// drops are skipped (see AttnArgs), so a row of a left-padded batch gets the bits it gets
// alone. One query row at a time, rows split over the pool. AVX-512 or AVX2 (the ISA in force
// when the node is built).
mx::array attention(
    const mx::array& q,
    const mx::array& k,
    const mx::array& v,
    float scale,
    bool causal,
    const std::optional<mx::array>& mask,
    mx::StreamOrDevice s = {});

// SwiGLU's gate * sigmoid(gate) * x for float32 gate and x of one shape (~6 compiled nodes in
// fast_math, ~8 ns an element there; ~1 here, split over the pool when large). AVX-512 or AVX2.
mx::array silu_mul(const mx::array& gate, const mx::array& x, mx::StreamOrDevice s = {});

class SiluMul : public mx::UnaryPrimitive {
 public:
  SiluMul(mx::Stream stream, Isa isa) : mx::UnaryPrimitive(stream), isa_(isa) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelSiluMul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const SiluMul*>(&other);
    return o != nullptr && o->isa_ == isa_;
  }

 private:
  Isa isa_;
};

class Attention : public mx::UnaryPrimitive {
 public:
  Attention(mx::Stream stream, float scale, bool causal, Isa isa)
      : mx::UnaryPrimitive(stream), scale_(scale), causal_(causal), isa_(isa) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelAttention";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float scale_;
  bool causal_;
  Isa isa_;
};

class RmsNorm : public mx::UnaryPrimitive {
 public:
  RmsNorm(mx::Stream stream, float eps) : mx::UnaryPrimitive(stream), eps_(eps) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelRmsNorm";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  float eps_;
};

class Rope : public mx::UnaryPrimitive {
 public:
  Rope(mx::Stream stream, int dims, bool traditional, float base, float scale)
      : mx::UnaryPrimitive(stream),
        dims_(dims),
        traditional_(traditional),
        base_(base),
        scale_(scale) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelRope";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int dims_;
  bool traditional_;
  float base_;
  float scale_;
};

}  // namespace mlxcel_native
