"""The prompt (prefix) cache, on the compute thread: mlx-lm's LRUPromptCache plus counters.

A finished sequence donates its KV cache, keyed by tenant and the tokens it holds; a new
sequence whose prompt shares a prefix with a donated one starts from a copy of that cache and
only prefills the rest. mlx-lm's trie finds the nearest entry and trims a longer one down to
the shared prefix; its LRU bounds the bytes held.

An entry is evaluated when it is stored. A row's cache leaves the batch as a lazy slice of the
batch's KV buffers (mlx-lm's ``BatchKVCache.extract``), and an unevaluated slice keeps its
whole source alive: every row of the batch, every layer, with the preallocated room. Stored
lazily, each entry of a 135M model held ~60 MB while counting ~2 MB, and the server grew
without bound under batched traffic (21 GB in 13 minutes). Evaluated, an entry owns a buffer
of exactly the bytes it counts, so the LRU's byte budget (``--cache-ram``) is what it holds.

An entry also says how many of its first tokens hold the KV that reading them fresh computes
(``EXACT``): tokens read in prompt passes from such a start do, whatever their chunks; the
prompt's last token and the answer, computed in decode steps (float32 below 12 rows, int8 in
prompt passes), do not. A seeded prompt reuses only those (``lookup(..., exact=True)``), so
its answer is the one a fresh read gives (docs/reference/http-api.md#seeds).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, trim_prompt_cache

from mlxcel.models import mlx_lm_compat
from mlxcel.runtime.messages import CacheStats

MAX_ENTRIES = 256

# On each layer of an entry's cache: how many of its first tokens a fresh read computes alike.
# Copies and trimmed copies carry it along; an entry without it (a restored slot file) counts
# none.
EXACT = "mlxcel_exact_tokens"


class PromptCache:
    def __init__(self, max_bytes: int) -> None:
        self._max_bytes = max_bytes
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=max_bytes)
        self.hits = 0
        self.misses = 0
        self.evictions = 0

    def lookup(
        self, key: str, prompt: list[int], *, exact: bool = False
    ) -> tuple[list[Any] | None, int, int]:
        """A private copy of the nearest cache, how many prompt tokens it covers, and how many
        of those hold what a fresh read computes (``EXACT``). ``exact``: only those are served
        (the copy is trimmed to them)."""
        cache, rest = self._lru.fetch_nearest_cache(key, prompt)
        if cache is not None and not rest:
            # An exact hit still needs one token to feed the model: step back by one.
            if not can_trim_prompt_cache(cache):
                cache, rest = None, prompt
            else:
                trim_prompt_cache(cache, 1)
                rest = prompt[-1:]
        n = len(prompt) - len(rest)
        same = min(n, int(getattr(cache[0], EXACT, 0))) if cache else 0
        if exact and cache is not None and same < n:
            if same == 0 or not can_trim_prompt_cache(cache):
                cache = None
            else:
                trim_prompt_cache(cache, n - same)
                n = same
        if cache is None:
            self.misses += 1
            return None, 0, 0
        self.hits += 1
        return cache, n, same

    def store(self, key: str, tokens: list[int], cache: list[Any], exact: int = 0) -> None:
        """Keep ``cache`` (of these tokens), whose first ``exact`` tokens hold what a fresh
        read computes."""
        for layer in cache:
            setattr(layer, EXACT, min(exact, len(tokens)))
        mx.eval(_arrays(cache))
        before = len(self._lru)
        self._lru.insert_cache(key, tokens, cache)
        # Entries that left besides the replaced prefix: LRU or byte-budget evictions.
        self.evictions += max(0, before + 1 - len(self._lru))

    def entry(self, key: str, tokens: list[int]) -> tuple[list[Any] | None, int]:
        """The cache of the longest prefix of these tokens held, and its length. The entry
        stored for exactly these tokens comes as it is (read it, never change it); one that
        a longer sequence has since replaced comes as a trimmed copy."""
        exact = mlx_lm_compat.lru_exact(self._lru, key, tokens)
        if exact is not None:
            return exact, len(tokens)
        cache, rest = self._lru.fetch_nearest_cache(key, tokens)
        if cache is None:
            return None, 0
        mx.eval(_arrays(cache))
        return cache, len(tokens) - len(rest)

    def remove(self, key: str, tokens: list[int]) -> bool:
        """Drop the entry for exactly these tokens (a slot erase)."""
        return mlx_lm_compat.lru_remove(self._lru, key, tokens)

    def reset(self) -> None:
        self._lru = LRUPromptCache(max_size=MAX_ENTRIES, max_bytes=self._max_bytes)

    def stats(self) -> CacheStats:
        return CacheStats(
            entries=len(self._lru),
            nbytes=int(self._lru.nbytes),
            max_bytes=self._max_bytes,
            hits=self.hits,
            misses=self.misses,
            evictions=self.evictions,
        )


def _arrays(cache: list[Any]) -> list[Any]:
    """The arrays an entry holds, for every cache kind mlx-lm has (KV, rotating, quantised
    tuples, the recurrent layers' state lists)."""
    found = []
    for layer in cache:
        for name in ("keys", "values", "cache"):
            value = getattr(layer, name, None)
            if value is not None:
                found.append(value)
    return found
