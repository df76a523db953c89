#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include "ops.h"

namespace nb = nanobind;
using namespace nb::literals;

NB_MODULE(_ext, m) {
  m.doc() = "mlxcel's CPU matmul kernels for quantised and bfloat16 weights (see __init__.py)";
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
      "stream"_a = nb::none());
  m.def("bf16_matmul", &mlxcel_native::bf16_matmul, "x"_a, "w"_a, nb::kw_only(),
        "stream"_a = nb::none());
  m.def("kernel_isa", &mlxcel_native::kernel_isa);
  m.def("force_generic", &mlxcel_native::force_generic, "on"_a);
  m.def("pool_threads", &mlxcel_native::pool_threads);
  m.def("set_int8_activations", &mlxcel_native::set_int8_activations, "mode"_a);
  m.def("int8_activations", &mlxcel_native::int8_activations);
}
