"""Put a loaded model's quantised layers on the native kernels, and check it against float32.

``install`` is what the loader would do with a model kept quantised; ``compare_greedy`` is the
model-level check (tests/unit/test_native_kernels.py runs it on the default model): same greedy
tokens, logits within a tolerance of the float32 model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx
import mlx.nn as nn

from mlxcel.native import quantized_matmul

__all__ = ["Comparison", "compare_greedy", "install"]

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


def _fits(module: nn.Module) -> bool:
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
        if type(module) is nn.QuantizedLinear and _fits(module):
            module.__class__ = NativeQuantizedLinear
        elif type(module) is nn.QuantizedEmbedding and _fits(module):
            module.__class__ = NativeQuantizedEmbedding
        else:
            continue
        count += 1
    return count


@attrs.frozen
class Comparison:
    """``max_rel_diff``: the largest logit difference over the reference's largest |logit|,
    over every position of the reference's greedy sequence."""

    reference_tokens: tuple[int, ...]
    candidate_tokens: tuple[int, ...]
    max_abs_diff: float
    max_rel_diff: float


def _scalar(a: mx.array) -> float:
    value = a.item()
    assert isinstance(value, int | float), value
    return float(value)


def _greedy(model: nn.Module, prompt: Sequence[int], steps: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(steps):
        logits = model(mx.array([tokens]))
        tokens.append(int(_scalar(mx.argmax(logits[0, -1]))))
    return tokens[len(prompt) :]


def compare_greedy(
    reference: nn.Module, candidate: nn.Module, prompt: Sequence[int], steps: int = 8
) -> Comparison:
    """Greedy-decode ``steps`` tokens with both models (no cache: the whole sequence each step),
    then compare their float32 logits over the reference's sequence."""
    ref_tokens = _greedy(reference, prompt, steps)
    cand_tokens = _greedy(candidate, prompt, steps)
    sequence = mx.array([list(prompt) + ref_tokens])
    ref = reference(sequence).astype(mx.float32)
    cand = candidate(sequence).astype(mx.float32)
    diff = _scalar(mx.abs(ref - cand).max())
    scale = _scalar(mx.abs(ref).max())
    return Comparison(
        reference_tokens=tuple(ref_tokens),
        candidate_tokens=tuple(cand_tokens),
        max_abs_diff=diff,
        max_rel_diff=diff / scale if scale else diff,
    )
