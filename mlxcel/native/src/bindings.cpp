#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/variant.h>

#include "ops.h"
#include "row_ops.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlxcel's CPU matmul kernels for quantised and bfloat16 weights, RMSNorm and RoPE (see __init__.py)";
  m.def(
      "quantized_matmul",
      &mlxcel_native::quantized_matmul,
      "x"_a,
      "w"_a,
      "scales"_a,
      "biases"_a,
      nb::kw_only(),
      "group_size"_a,
      "bits"_a,
      "int8"_a = -1,
      "stream"_a = nb::none());
  m.def("bf16_matmul", &mlxcel_native::bf16_matmul, "x"_a, "w"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("kquant_matmul", &mlxcel_native::kquant_matmul, "x"_a, "w"_a, nb::kw_only(), "format"_a,
        "int8"_a = -1, "stream"_a = nb::none());
  m.def("rms_norm", &mlxcel_native::rms_norm, "x"_a, "w"_a, "eps"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("rope", &mlxcel_native::rope, "x"_a, "dims"_a, nb::kw_only(), "traditional"_a, "base"_a,
        "scale"_a, "offset"_a, "freqs"_a = nb::none(), "stream"_a = nb::none());
  m.def("attention", &mlxcel_native::attention, "q"_a, "k"_a, "v"_a, nb::kw_only(), "scale"_a,
        "causal"_a, "mask"_a = nb::none(), "stream"_a = nb::none());
  m.def("silu_mul", &mlxcel_native::silu_mul, "gate"_a, "x"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("kernel_isa", &mlxcel_native::kernel_isa);
  m.def("set_isa_cap", &mlxcel_native::set_isa_cap, "isa"_a);
  m.def("force_generic", &mlxcel_native::force_generic, "on"_a);
  m.def("pool_threads", &mlxcel_native::pool_threads);
  m.def("set_int8_activations", &mlxcel_native::set_int8_activations, "mode"_a);
  m.def("int8_activations", &mlxcel_native::int8_activations);
}
