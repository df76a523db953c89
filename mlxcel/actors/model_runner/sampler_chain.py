"""The per-request sampling chain, in llama.cpp b10621's fixed order (compute thread only).

    logit bias -> penalties (repetition / presence / frequency) -> DRY        logits processors
    -> top-n-sigma -> top-k -> typical -> top-p -> min-p -> XTC -> temperature  sampler

The first three run as mlx-lm logits processors, one row at a time on ``(context, logits[1, V])``
where the context is the prompt plus what was generated (llama-server feeds the prompt through
its samplers too). The filters run inside the sampler on untempered log-probabilities, each
renormalising over what the previous one kept, and the temperature only scales the final draw.
Temperature 0 is an argmax over what the filters kept, as llama.cpp's temp sampler does.

mlx-lm's BatchGenerator draws for the whole batch in one call when every row holds the same
sampler object, so ``build`` returns one cached sampler per distinct set of filter settings for
every unseeded request, whatever its processors. A seeded request gets a private key, split per
draw, so its tokens do not depend on what else is in the batch. Everything is array work on the
device; nothing syncs with the host (see ``dry`` for DRY's cost).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import lru_cache

import attrs
import mlx.core as mx
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, greedy_sampler

from mlxcel.actors.model_runner.dry import Breakers, breakers_from_strings, make_dry
from mlxcel.runtime.messages import SamplingParams
from mlxcel.runtime.sampling_rules import validate

__all__ = ["SamplerConfig", "build", "validate"]

Processor = Callable[[mx.array, mx.array], mx.array]
Sampler = Callable[[mx.array], mx.array]
Filter = Callable[[mx.array, mx.array | None], mx.array]

_NEG_INF = float("-inf")


# The settings and their range checks are pure and live with the messages (no mlx there).
SamplerConfig = SamplingParams


# -- logits processors ------------------------------------------------------------------------


def _make_logit_bias(bias: tuple[tuple[int, float], ...]) -> Processor:
    ids = mx.array([t for t, _ in bias], dtype=mx.int32)
    values = mx.array([b for _, b in bias], dtype=mx.float32)

    def logit_bias(_tokens: mx.array, logits: mx.array) -> mx.array:
        return logits.at[:, ids].add(values.astype(logits.dtype))

    return logit_bias


def _make_penalties(repeat: float, presence: float, frequency: float, last_n: int) -> Processor:
    """llama.cpp's penalties sampler: one window, sign-aware repeat, then count-based terms."""

    def penalties(tokens: mx.array, logits: mx.array) -> mx.array:
        window = tokens if last_n < 0 else tokens[-last_n:]
        if window.size == 0:
            return logits
        # Work on the window's tokens only (a repeated token just writes the same value twice);
        # the one vocabulary-wide op is the count table.
        counts = mx.zeros((logits.shape[-1],), dtype=mx.float32).at[window].add(1.0)[window]
        x = logits[:, window].astype(mx.float32)
        penalised = mx.where(x <= 0, x * repeat, x / repeat) - counts * frequency - presence
        out = mx.array(logits)
        out[:, window] = penalised.astype(logits.dtype)
        return out

    return penalties


def _processors(
    config: SamplerConfig,
    vocab_size: int,
    encode: Callable[[str], list[int]],
    token_texts: list[str] | None,
) -> list[Processor]:
    out: list[Processor] = []
    if config.logit_bias:
        out.append(_make_logit_bias(config.logit_bias))
    if config.repetition_context_size != 0 and (
        config.repetition_penalty != 1.0
        or config.presence_penalty != 0.0
        or config.frequency_penalty != 0.0
    ):
        out.append(
            _make_penalties(
                config.repetition_penalty,
                config.presence_penalty,
                config.frequency_penalty,
                config.repetition_context_size,
            )
        )
    if config.dry_multiplier != 0.0 and config.dry_base >= 1.0 and config.dry_penalty_last_n != 0:
        breakers = (
            breakers_from_strings(
                config.dry_sequence_breakers, encode=encode, token_texts=token_texts
            )
            if config.dry_sequence_breakers
            else Breakers()
        )
        dry = make_dry(
            multiplier=config.dry_multiplier,
            base=config.dry_base,
            allowed_length=config.dry_allowed_length,
            penalty_last_n=config.dry_penalty_last_n,
            breakers=breakers,
            vocab_size=vocab_size,
        )
        if dry is not None:
            out.append(dry)
    return out


# -- filters (on untempered log-probabilities, [B, V]) -----------------------------------------


def top_n_sigma(x: mx.array, n: float) -> mx.array:
    """Keep logits within n standard deviations (over the kept ones) of the maximum."""
    xf = x.astype(mx.float32)
    kept = xf > _NEG_INF
    count = kept.sum(axis=-1, keepdims=True)
    mean = mx.where(kept, xf, 0.0).sum(axis=-1, keepdims=True) / count
    var = mx.where(kept, mx.square(xf - mean), 0.0).sum(axis=-1, keepdims=True) / count
    floor = xf.max(axis=-1, keepdims=True) - n * mx.sqrt(var)
    return mx.where(xf < floor, _NEG_INF, x)


def top_k(x: mx.array, k: int) -> mx.array:
    if k <= 0 or k >= x.shape[-1]:
        return x
    return apply_top_k(x, k)


def typical(x: mx.array, p: float) -> mx.array:
    """Locally typical sampling: keep the tokens whose surprise is closest to the entropy."""
    xf = x.astype(mx.float32)
    logp = xf - mx.logsumexp(xf, axis=-1, keepdims=True)
    probs = mx.exp(logp)
    kept = probs > 0
    entropy = -mx.where(kept, probs * logp, 0.0).sum(axis=-1, keepdims=True)
    score = mx.where(kept, mx.abs(-logp - entropy), math.inf)
    order = mx.argsort(score, axis=-1)
    sorted_probs = mx.take_along_axis(probs, order, axis=-1)
    # llama.cpp keeps tokens up to and including the one whose running sum first exceeds p.
    before = mx.cumsum(sorted_probs, axis=-1) - sorted_probs
    keep_sorted = before <= p
    keep = mx.put_along_axis(mx.zeros(x.shape, dtype=mx.bool_), order, keep_sorted, axis=-1)
    return mx.where(keep & kept, x, _NEG_INF)


def top_p(x: mx.array, p: float) -> mx.array:
    if p >= 1.0:
        return x
    if p <= 0.0:  # llama.cpp keeps the single most likely token
        return mx.where(x < x.max(axis=-1, keepdims=True), _NEG_INF, x)
    return apply_top_p(x, p)


def min_p(x: mx.array, p: float) -> mx.array:
    return x if p <= 0.0 else apply_min_p(x, p)


def xtc(x: mx.array, probability: float, threshold: float, draw: mx.array) -> mx.array:
    """Exclude Top Choices: when ``draw`` <= probability, drop every token at or above the
    threshold except the least likely of them (only if at least two are above it).

    ``draw`` is a uniform [B, 1] sample, one per row.
    """
    probs = mx.softmax(x.astype(mx.float32), axis=-1)
    above = (probs >= threshold) & (x > _NEG_INF)
    least = mx.where(above, probs, math.inf).min(axis=-1, keepdims=True)
    remove = above & (probs > least) & (draw <= probability)
    return mx.where(remove, _NEG_INF, x)


# -- samplers -----------------------------------------------------------------------------------


@attrs.frozen
class _Filters:
    temperature: float
    top_n_sigma: float
    top_k: int
    typical_p: float
    top_p: float
    min_p: float
    xtc_probability: float
    xtc_threshold: float

    @classmethod
    def of(cls, config: SamplerConfig) -> _Filters:
        greedy = config.temperature <= 0.0
        xtc_on = config.xtc_probability > 0.0 and config.xtc_threshold <= 0.5
        # Under greedy the filters that always keep the top token cannot change the argmax.
        return cls(
            temperature=0.0 if greedy else config.temperature,
            top_n_sigma=0.0 if greedy else max(config.top_n_sigma, 0.0),
            top_k=0 if greedy else max(config.top_k, 0),
            typical_p=min(config.typical_p, 1.0),
            top_p=1.0 if greedy else min(config.top_p, 1.0),
            min_p=0.0 if greedy else max(config.min_p, 0.0),
            xtc_probability=config.xtc_probability if xtc_on else 0.0,
            xtc_threshold=config.xtc_threshold if xtc_on else 0.0,
        )

    @property
    def random(self) -> bool:
        return self.temperature > 0.0 or self.xtc_probability > 0.0

    def sample(self, x: mx.array, xtc_draw: mx.array | None, key: mx.array | None) -> mx.array:
        """Filter [B, V] log-probabilities in chain order, then draw one token per row."""
        if self.top_n_sigma > 0.0:
            x = top_n_sigma(x, self.top_n_sigma)
        # After top-k only k candidates remain (llama.cpp truncates its list there too), so the
        # later stages sort and draw over [B, k] instead of [B, V].
        kept = None
        if 0 < self.top_k < x.shape[-1]:
            kept = mx.argpartition(-x, kth=self.top_k - 1, axis=-1)[..., : self.top_k]
            # In token-id order: argpartition's order follows the logits' last bits, which
            # change with the batch, and the draw's noise goes by position, so an unsorted
            # list gave a seeded row another token whenever its neighbours changed.
            kept = mx.sort(kept, axis=-1)
            x = mx.take_along_axis(x, kept, axis=-1)
        if self.typical_p < 1.0:
            x = typical(x, self.typical_p)
        x = top_p(x, self.top_p)
        x = min_p(x, self.min_p)
        if xtc_draw is not None:
            x = xtc(x, self.xtc_probability, self.xtc_threshold, xtc_draw)
        if self.temperature <= 0.0:
            token = mx.argmax(x, axis=-1)
        else:
            token = mx.random.categorical(x * (1.0 / self.temperature), key=key)
        if kept is not None:
            token = mx.take_along_axis(kept, token[:, None], axis=-1)[:, 0]
        return token


@lru_cache(maxsize=256)
def _shared(filters: _Filters) -> Sampler:
    if filters == _Filters.of(SamplerConfig(temperature=0.0)):
        return greedy_sampler

    def sample(logprobs: mx.array) -> mx.array:
        draw = None
        if filters.xtc_probability > 0.0:
            draw = mx.random.uniform(shape=(logprobs.shape[0], 1))
        return filters.sample(logprobs, draw, None)

    return sample


class SeededSampler:
    """A private PRNG stream: the same seed gives the same draws alone or in a batch."""

    def __init__(self, filters: _Filters, seed: int) -> None:
        self._filters = filters
        self._key = mx.random.key(seed)

    def __call__(self, logprobs: mx.array) -> mx.array:
        self._key, xtc_key, draw_key = mx.random.split(self._key, 3)
        draw = None
        if self._filters.xtc_probability > 0.0:
            draw = mx.random.uniform(shape=(logprobs.shape[0], 1), key=xtc_key)
        return self._filters.sample(logprobs, draw, draw_key)


def build(
    config: SamplerConfig,
    *,
    vocab_size: int,
    encode: Callable[[str], list[int]],
    token_texts: list[str] | None = None,
) -> tuple[list[Processor], Sampler]:
    """The logits processors and the sampler for one request (``validate`` it first).

    ``vocab_size`` is the width of the model's logits row. ``encode`` turns a DRY sequence
    breaker into token ids without special tokens; ``token_texts`` (each id decoded alone)
    switches breaker matching to llama.cpp's token-overlap rules (see ``dry``).
    """
    processors = _processors(config, vocab_size, encode, token_texts)
    filters = _Filters.of(config)
    if config.seed is None or not filters.random:
        return processors, _shared(filters)
    return processors, SeededSampler(filters, config.seed)
