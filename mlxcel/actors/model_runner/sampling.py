"""Per-request samplers for mlx-lm's BatchGenerator (compute thread only).

BatchGenerator samples the whole batch in one call when every row holds the *same* sampler
object, so unseeded requests with equal settings share one cached sampler. A seeded request
gets its own sampler with a private PRNG key, which keeps its output identical whether it runs
alone or in a batch, without a serial fallback: only the draw is per row, the forward pass
stays batched.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache

import mlx.core as mx
from mlx_lm.sample_utils import apply_top_p, greedy_sampler

from mlxcel.runtime.messages import SamplingParams

Sampler = Callable[[mx.array], mx.array]


def _filter(params: SamplingParams) -> Callable[[mx.array], mx.array]:
    if 0.0 < params.top_p < 1.0:
        top_p = params.top_p
        return lambda logprobs: apply_top_p(logprobs, top_p)
    return lambda logprobs: logprobs


@lru_cache(maxsize=256)
def _shared(params: SamplingParams) -> Sampler:
    if params.temperature == 0.0 or params.top_p == 0.0:
        return greedy_sampler
    filt = _filter(params)
    inv_temp = 1.0 / params.temperature

    def sample(logprobs: mx.array) -> mx.array:
        return mx.random.categorical(filt(logprobs) * inv_temp)

    return sample


class SeededSampler:
    def __init__(self, params: SamplingParams, seed: int) -> None:
        self._filter = _filter(params)
        self._inv_temp = 1.0 / params.temperature
        self._key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, draw = mx.random.split(self._key)
        return mx.random.categorical(self._filter(logprobs) * self._inv_temp, key=draw)


def make_sampler(params: SamplingParams) -> Sampler:
    if params.seed is None or params.temperature == 0.0 or params.top_p == 0.0:
        return _shared(params)
    return SeededSampler(params, params.seed)
