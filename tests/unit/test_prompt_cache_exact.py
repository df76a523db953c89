"""A prompt-cache entry says how many of its first tokens a fresh read computes alike, and a
seeded prompt is served only those (docs/reference/http-api.md#seeds)."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from mlxcel.actors.model_runner.prompt_cache import PromptCache

PROMPT = list(range(100, 130))  # what the first request read as its prompt
ANSWER = list(range(500, 510))  # what it generated (decode steps)


def entry(tokens: int) -> list[KVCache]:
    layers = []
    for _ in range(2):
        layer = KVCache()
        kv = mx.random.normal((1, 2, tokens, 8))
        layer.update_and_fetch(kv, kv)
        layers.append(layer)
    return layers


def filled() -> PromptCache:
    cache = PromptCache(1 << 26)
    # All of its prompt but the last token was read in prompt passes.
    cache.store("t", PROMPT + ANSWER, entry(len(PROMPT + ANSWER)), exact=len(PROMPT) - 1)
    return cache


def test_a_seeded_follow_up_is_served_only_what_was_read_as_a_prompt() -> None:
    follow = PROMPT + ANSWER + [7, 8, 9]
    cache, n, same = filled().lookup("t", follow)
    assert cache is not None and n == len(PROMPT + ANSWER) and same == len(PROMPT) - 1
    cache, n, same = filled().lookup("t", follow, exact=True)
    assert cache is not None and n == same == len(PROMPT) - 1
    assert cache[0].offset == len(PROMPT) - 1  # trimmed to what it serves


def test_a_prefix_within_the_exact_part_is_served_whole() -> None:
    other = PROMPT[:20] + [1, 2, 3]
    cache, n, same = filled().lookup("t", other, exact=True)
    assert cache is not None and n == same == 20


def test_an_entry_of_unknown_making_serves_a_seeded_prompt_nothing() -> None:
    cache = PromptCache(1 << 26)
    cache.store("t", PROMPT, entry(len(PROMPT)))  # a restored slot file: exact unknown
    assert cache.lookup("t", PROMPT + [1], exact=True) == (None, 0, 0)
    found, n, same = cache.lookup("t", PROMPT + [1])
    assert found is not None and n == len(PROMPT) and same == 0
    # What it reports: one miss, one hit.
    assert (cache.stats().misses, cache.stats().hits) == (1, 1)
