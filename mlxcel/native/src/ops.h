// mlx operations over the kernels: each builds a graph node whose CPU evaluation is dispatched
// through mlx's CPU command encoder, so it runs asynchronously and in stream order like mlx's
// own primitives. There is no GPU evaluation: callers keep these on the CPU device.
#pragma once

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxcel_native {

// mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits) for float32 x
// [..., K], computed in float32: out[..., N].
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    mx::StreamOrDevice s = {});

// x @ w.T for float32 x [..., K] and bfloat16 w [N, K], computed in float32.
mx::array bf16_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// Which kernels run: "avx512" when the CPU has AVX-512 F/BW/VL/DQ with FMA and F16C, else
// "generic". force_generic(true) selects the portable kernels (tests compare both).
const char* kernel_isa();
void force_generic(bool on);
int pool_threads();

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  QuantizedMatmul(mx::Stream stream, int group_size, int bits)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
};

class Bf16Matmul : public mx::UnaryPrimitive {
 public:
  explicit Bf16Matmul(mx::Stream stream) : mx::UnaryPrimitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelBf16Matmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    return dynamic_cast<const Bf16Matmul*>(&other) != nullptr;
  }
};

}  // namespace mlxcel_native
