"""A loaded model's affine 4/8-bit and bfloat16 layers, run on the native kernels
(``mlxcel.native``).

The loader calls ``install`` (and ``install_bf16``) on the CPU instead of converting those
layers to float32: the weights stay as stored (a Q4_1 GGUF's 4.5 bits per weight, a bfloat16
checkpoint's 16, rather than 32), and every matmul computes in float32 from them, so the
logits are the float32 model's up to summation order (bfloat16 widens to float32 exactly).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from mlxcel.native import bf16_matmul, kquant_matmul, kquants, quantized_matmul, rms_norm, rope

__all__ = [
    "NativeBf16Embedding",
    "NativeBf16Linear",
    "NativeQuantizedEmbedding",
    "NativeQuantizedLinear",
    "KQUANT_LAYERS",
    "NativeKQuantEmbedding",
    "NativeKQuantLinear",
    "NativeRMSNorm",
    "NativeRoPE",
    "fits",
    "install",
    "install_bf16",
    "install_row_ops",
]

_BITS = (4, 8)
_GROUPS = (32, 64, 128)


class NativeQuantizedLinear(nn.QuantizedLinear):
    """nn.QuantizedLinear whose matmul is mlxcel.native.quantized_matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        y = quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            group_size=self.group_size,
            bits=self.bits,
        )
        return y + self["bias"] if "bias" in self else y


class NativeQuantizedEmbedding(nn.QuantizedEmbedding):
    """nn.QuantizedEmbedding whose tied output projection (as_linear) is native, and whose
    lookup dequantises in float32 (mlx's rounds each row to the scales' float16)."""

    def __call__(self, x: mx.array) -> mx.array:
        return mx.dequantize(
            self["weight"][x],
            scales=self["scales"][x].astype(mx.float32),
            biases=self["biases"][x].astype(mx.float32),
            group_size=self.group_size,
            bits=self.bits,
        )

    def as_linear(self, x: mx.array) -> mx.array:
        return quantized_matmul(
            x,
            self["weight"],
            self["scales"],
            self["biases"],
            group_size=self.group_size,
            bits=self.bits,
        )


class _KQuantBlocks(nn.Module):
    """A matrix [output_dims, input_dims] held as GGUF's blocks of one K-quant format
    (``weight``: uint8 [output_dims, input_dims / 256 * block bytes]; ``fmt``: ``"q4_k"`` or
    ``"q6_k"``, ``mlxcel.native.kquants``)."""

    def __init__(self, weight: mx.array, fmt: str) -> None:
        super().__init__()
        self.weight = weight
        self.fmt = fmt

    @property
    def input_dims(self) -> int:
        return kquants.inputs(self["weight"], self.fmt)

    @property
    def output_dims(self) -> int:
        return int(self["weight"].shape[0])

    def _extra_repr(self) -> str:
        return f"{self.input_dims}, {self.output_dims}, fmt={self.fmt}"


class NativeKQuantLinear(_KQuantBlocks):
    """A Linear layer whose weight stays as K-quant blocks, multiplied by
    mlxcel.native.kquant_matmul."""

    def __init__(self, weight: mx.array, fmt: str, bias: mx.array | None = None) -> None:
        super().__init__(weight, fmt)
        if bias is not None:
            self.bias = bias

    def __call__(self, x: mx.array) -> mx.array:
        y = kquant_matmul(x, self["weight"], self.fmt)
        return y + self["bias"] if "bias" in self else y


class NativeKQuantEmbedding(_KQuantBlocks):
    """An Embedding whose table stays as K-quant blocks: a lookup dequantises the rows it takes
    (float32, the file's values exactly); the tied output projection (``as_linear``) is
    kquant_matmul."""

    def __call__(self, x: mx.array) -> mx.array:
        return kquants.dequantize(self["weight"][x], self.fmt)

    def as_linear(self, x: mx.array) -> mx.array:
        return kquant_matmul(x, self["weight"], self.fmt)


# The layers held as K-quant blocks (what counts parameters or adapts a layer looks for these).
KQUANT_LAYERS = (NativeKQuantLinear, NativeKQuantEmbedding)


def fits(module: nn.Module) -> bool:
    return (
        getattr(module, "mode", "affine") == "affine"
        and getattr(module, "bits", None) in _BITS
        and getattr(module, "group_size", None) in _GROUPS
        and "biases" in module
    )


def install(model: nn.Module) -> int:
    """Switch the affine 4/8-bit QuantizedLinear and QuantizedEmbedding layers of ``model`` to
    the native kernels in place (same parameters, new class); returns how many."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.QuantizedLinear and fits(module):
            module.__class__ = NativeQuantizedLinear
        elif type(module) is nn.QuantizedEmbedding and fits(module):
            module.__class__ = NativeQuantizedEmbedding
        else:
            continue
        count += 1
    return count


class NativeBf16Linear(nn.Linear):
    """nn.Linear that keeps its bfloat16 weight and multiplies with mlxcel.native.bf16_matmul
    (float32 activations; the bias, if any, is float32)."""

    def __call__(self, x: mx.array) -> mx.array:
        y = bf16_matmul(x, self["weight"])
        return y + self["bias"] if "bias" in self else y


class NativeBf16Embedding(nn.Embedding):
    """nn.Embedding that keeps its bfloat16 table: rows widen to float32 on lookup, and the
    tied output projection (as_linear) is native."""

    def __call__(self, x: mx.array) -> mx.array:
        rows: mx.array = self["weight"][x]
        return rows.astype(mx.float32)

    def as_linear(self, x: mx.array) -> mx.array:
        return bf16_matmul(x, self["weight"])


def install_bf16(model: nn.Module) -> list[str]:
    """Switch the Linear and Embedding layers of ``model`` whose weight is bfloat16 to the
    native kernels in place; returns the paths of the weights they keep in bfloat16 (the
    loader casts everything else to float32)."""
    kept: list[str] = []
    for name, module in model.named_modules():
        if "weight" not in module or module["weight"].dtype != mx.bfloat16:
            continue
        if type(module) is nn.Linear:
            module.__class__ = NativeBf16Linear
        elif type(module) is nn.Embedding:
            module.__class__ = NativeBf16Embedding
        else:
            continue
        kept.append(f"{name}.weight" if name else "weight")
    return kept


class NativeRMSNorm(nn.RMSNorm):
    """nn.RMSNorm as one native node (mlx builds ~11 on the CPU)."""

    def __call__(self, x: mx.array) -> mx.array:
        return rms_norm(x, self["weight"], self.eps)


class NativeRoPE(nn.RoPE):
    """nn.RoPE as one native node (mlx builds ~29 on the CPU)."""

    def __call__(self, x: mx.array, offset: int | mx.array = 0) -> mx.array:
        return rope(
            x,
            self.dims,
            traditional=self.traditional,
            base=self.base,
            scale=self.scale,
            offset=offset,
        )


def install_row_ops(model: nn.Module) -> int:
    """Switch ``model``'s plain nn.RMSNorm and nn.RoPE layers to their native nodes in place
    (subclasses of them, such as a model's own norm with another formula, are left alone);
    returns how many. Only for a model running on the CPU: the native nodes have no GPU
    kernels, and Metal and CUDA have mlx's own."""
    count = 0
    for _, module in model.named_modules():
        if type(module) is nn.RMSNorm:
            module.__class__ = NativeRMSNorm
        elif type(module) is nn.RoPE:
            module.__class__ = NativeRoPE
        else:
            continue
        count += 1
    return count
