// mlx operations over the kernels: each builds a graph node whose CPU evaluation is dispatched
// through mlx's CPU command encoder, so it runs asynchronously and in stream order like mlx's
// own primitives. There is no GPU evaluation: callers keep these on the CPU device.
#pragma once

#include <string>

#include "mlx/ops.h"
#include "mlx/primitives.h"

namespace mx = mlx::core;

namespace mlxcel_native {

// mx.quantized_matmul(x, w, scales, biases, transpose=True, group_size, bits) for float32 x
// [..., K], computed in float32: out[..., N]. `int8`: this node's Int8Mode (below), or -1 for
// the process's (set_int8_activations); a mode asked for is off where the CPU has no int8.
mx::array quantized_matmul(
    const mx::array& x,
    const mx::array& w,
    const mx::array& scales,
    const mx::array& biases,
    int group_size,
    int bits,
    int int8 = -1,
    mx::StreamOrDevice s = {});

// x @ w.T for float32 x [..., K] and bfloat16 w [N, K], computed in float32.
mx::array bf16_matmul(const mx::array& x, const mx::array& w, mx::StreamOrDevice s = {});

// x @ W.T for float32 x [..., K] and W [N, K] held as GGUF's blocks of one K-quant `format`
// ("q4_k": w uint8 [N, K / 256 * 144]; "q6_k": [N, K / 256 * 210]; kernels.h), computed in
// float32 (with int8 activations where set_int8_activations says, or `int8` for this node, as
// quantized_matmul).
mx::array kquant_matmul(const mx::array& x, const mx::array& w, const std::string& format,
                        int int8 = -1, mx::StreamOrDevice s = {});

// Which kernels run: "avx512" when the CPU has AVX-512 F/BW/VL/DQ with FMA and F16C, "avx2"
// when it has AVX2 with FMA and F16C, else "generic" (portable C++), chosen at run time.
// set_isa_cap caps it ("avx512" caps nothing; MLXCEL_NATIVE_ISA sets the cap at start, read
// once) and returns the ISA now in force; force_generic(true) selects the portable kernels
// whatever the cap (tests compare them all). Graphs take the ISA in force when evaluated
// (matmuls) or built (attention, silu_mul, which have no portable kernels).
enum class Isa : int { generic = 0, avx2 = 1, avx512 = 2 };
Isa active_isa();
const char* kernel_isa();
const char* set_isa_cap(const std::string& isa);
void force_generic(bool on);
int pool_threads();
// int8 activations for quantized matmuls (see kernels_vnni.cpp): `many_rows` from
// kRowsKernelMin rows on (float32 below), `every_row` at every row count, so that a row's
// result never depends on the rows beside it (--batch-invariant). set_int8_activations asks
// for a mode and returns the one in force (off without AVX512-VNNI or when forced generic).
enum class Int8Mode : int { off = 0, many_rows = 1, every_row = 2 };
int set_int8_activations(int mode);
int int8_activations();

class QuantizedMatmul : public mx::UnaryPrimitive {
 public:
  // `int8`: the Int8Mode in force when the graph was built (so a graph computes what it was
  // built to, whatever the setting is when it is evaluated).
  QuantizedMatmul(mx::Stream stream, int group_size, int bits, int int8)
      : mx::UnaryPrimitive(stream), group_size_(group_size), bits_(bits), int8_(int8) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelQuantizedMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override;

 private:
  int group_size_;
  int bits_;
  int int8_;
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

class KQuantMatmul : public mx::UnaryPrimitive {
 public:
  // `format`: a KQuant; `int8`: the Int8Mode in force when the graph was built, as for
  // QuantizedMatmul.
  KQuantMatmul(mx::Stream stream, int format, int int8)
      : mx::UnaryPrimitive(stream), format_(format), int8_(int8) {}
  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  void eval_gpu(const std::vector<mx::array>& inputs, mx::array& out) override;
  const char* name() const override {
    return "MlxcelKQuantMatmul";
  }
  bool is_equivalent(const mx::Primitive& other) const override {
    const auto* o = dynamic_cast<const KQuantMatmul*>(&other);
    return o != nullptr && o->format_ == format_ && o->int8_ == int8_;
  }

 private:
  int format_;
  int int8_;
};

}  // namespace mlxcel_native
