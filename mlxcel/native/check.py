"""A model on the native kernels against the same model in float32.

``compare_greedy`` is the model-level check (tests/unit/test_native_kernels.py runs it on the
default model, as the loader sets it up): same greedy tokens, logits within a tolerance of the
float32 model's.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import mlx.core as mx
import mlx.nn as nn

__all__ = ["Comparison", "compare_greedy"]


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
