# Types of the C++ extension (src/bindings.cpp).
import mlx.core as mx

def quantized_matmul(
    x: mx.array,
    w: mx.array,
    scales: mx.array,
    biases: mx.array,
    *,
    group_size: int,
    bits: int,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def bf16_matmul(
    x: mx.array, w: mx.array, *, stream: mx.Stream | mx.Device | None = None
) -> mx.array: ...
def kernel_isa() -> str: ...
def force_generic(on: bool) -> None: ...
def pool_threads() -> int: ...
