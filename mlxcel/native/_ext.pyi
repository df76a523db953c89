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
    int8: int = -1,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def bf16_matmul(
    x: mx.array, w: mx.array, *, stream: mx.Stream | mx.Device | None = None
) -> mx.array: ...
def kquant_matmul(
    x: mx.array,
    w: mx.array,
    *,
    format: str,
    int8: int = -1,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def rms_norm(
    x: mx.array, w: mx.array, eps: float, *, stream: mx.Stream | mx.Device | None = None
) -> mx.array: ...
def rope(
    x: mx.array,
    dims: int,
    *,
    traditional: bool,
    base: float,
    scale: float,
    offset: mx.array,
    freqs: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def attention(
    q: mx.array,
    k: mx.array,
    v: mx.array,
    *,
    scale: float,
    causal: bool,
    mask: mx.array | None = None,
    stream: mx.Stream | mx.Device | None = None,
) -> mx.array: ...
def silu_mul(
    gate: mx.array, x: mx.array, *, stream: mx.Stream | mx.Device | None = None
) -> mx.array: ...
def kernel_isa() -> str: ...
def set_isa_cap(isa: str) -> str: ...
def force_generic(on: bool) -> None: ...
def pool_threads() -> int: ...
def set_int8_activations(mode: int) -> int: ...
def int8_activations() -> int: ...
