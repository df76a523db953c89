"""Everything mlxcel relies on inside mlx-lm beyond its public API: this file is the list.

mlx-lm's public face is small (``load``, ``BatchGenerator.insert / next / remove /
extract_cache``, the cache classes, ``LRUPromptCache``'s insert and fetch). Several things of ours
go further, and each goes through a named function or constant here, so that nothing else in
mlxcel names a private attribute of mlx-lm:

- eager start (``actors/model_runner/eager_start.py``) subclasses ``BatchGenerator`` and
  ``GenerationBatch``, overrides the private methods in ``OVERRIDDEN``, and moves rows between
  the generator's private queues (``generation_batch``, ``prompt_batch``, ``waiting``,
  ``reading``, ``prompt_batch_of``), reads and keeps its step totals (``counters``: the
  prefill budget) and a batch's private per-row state (``next_tokens``,
  ``next_logprobs``, ``row_counters``);
- the model runner reads where a row stands (``row_stages``: donation on cancel) and how many
  tokens it may still make (``tokens_left``: context shift), and the prompt cache reaches into
  ``LRUPromptCache``'s trie (``lru_exact``, ``lru_remove``: slot save and erase);
- ``install`` replaces ``BatchKVCache.extend`` with a version that copies the batch once, and
  ``BatchKVCache.merge`` with one that keeps a vision row's position shift (``models/vlm.py``);
- ``swap_model_functions`` puts ``fast_lm``'s attention and SwiGLU into the modules of
  ``mlx_lm.models`` that a loaded model's classes come from, and ``batch_left_padding`` tells
  that attention a plain batch cache's rows' padding (``--batch-invariant``);
- row reuse (``actors/model_runner/row_reuse.py``) puts a joining row in a finished one's
  place: its per-row state (``place_rows``) and its keys and values (``kv_rows_fit``,
  ``write_kv_rows``, ``live_left_padding``);
- LongRoPE (``models/longrope.py``) sets the divisors and input scale a ``SuScaledRoPE``
  keeps privately (``set_longrope``: the short factors, which mlx-lm never runs);
- speculation (``actors/model_runner/speculative_batch.py``) feeds a batch several tokens per
  row and takes back each row's rejected ones (``rewind_rows``, through ``BatchKVCache``'s
  right-padding roll), and sets a batch's pending tokens (``set_next_tokens``) and the state
  its logits processors see (``token_context``, ``set_current``).

These names are known good only for the mlx-lm versions in ``TESTED`` (pyproject.toml pins the
same range; ``tests/unit/test_mlx_lm_compat.py`` keeps the two equal and compares our patches
with mlx-lm's own output). ``install`` runs at start, before a model loads: outside the range
it raises ``IncompatibleMlxLm`` rather than let a renamed attribute or a changed meaning give
wrong tokens later. ``MLXCEL_UNTESTED_MLX_LM=1`` turns that into a warning, for an operator who
needs a newer mlx-lm (mlx-lm adds model families in minor releases) before we have tested it;
pip will not install one by accident, since the pin stops it.

Scope: mlx-lm builds every ``BatchKVCache`` in its own ``merge``, so a subclass of ours would
never be used, and its models call attention and SwiGLU as module globals, with no per-object
hook; so both patches are process-wide (the functions per model family). Both give what
mlx-lm's own give (tested), and the swapped functions hand anything they do not cover back to
mlx-lm's. ``install`` runs once, and swapping a model's functions again changes nothing.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import re
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any, cast

import mlx.core as mx
from mlx_lm.generate import BatchGenerator, GenerationBatch, PromptProcessingBatch
from mlx_lm.models.cache import BatchKVCache

from mlxcel.models.errors import IncompatibleMlxLm

__all__ = [
    "OVERRIDDEN",
    "TESTED",
    "batch_left_padding",
    "check_version",
    "counters",
    "current_logprobs",
    "generation_batch",
    "install",
    "kv_rows_fit",
    "live_left_padding",
    "lru_exact",
    "lru_remove",
    "next_logprobs",
    "next_tokens",
    "place_rows",
    "prompt_batch",
    "prompt_batch_of",
    "reading",
    "row_counters",
    "row_stages",
    "set_generation_batch",
    "set_longrope",
    "set_current",
    "set_next_logprobs",
    "set_next_tokens",
    "rewind_rows",
    "rewindable",
    "token_context",
    "set_prompt_batch",
    "set_reading",
    "swap_model_functions",
    "tokenizer_of",
    "tokens_left",
    "waiting",
    "waiting_prompt",
    "write_kv_rows",
]

log = logging.getLogger(__name__)

# The mlx-lm versions these internals were tested with: [first, below). Keep pyproject's pin
# the same (a unit test compares them).
TESTED = ("0.32.2", "0.33")
UNTESTED_ENV = "MLXCEL_UNTESTED_MLX_LM"

# Private methods our subclasses override (a test checks that they override no others).
OVERRIDDEN: dict[type, tuple[str, ...]] = {
    BatchGenerator: ("_next",),
    GenerationBatch: ("_step",),
}
# Private attributes we read or write, checked on the first generator built.
_GENERATOR_ATTRS = (
    "_generation_batch",
    "_prompt_batch",
    "_unprocessed_sequences",
    "_currently_processing",
    "_find_uids",
    "_counters",
)
_BATCH_ATTRS = (
    "_next_tokens",
    "_next_logprobs",
    "_num_tokens",
    "_matchers",
    "_token_context",
    "_current_tokens",
    "_current_logprobs",
)

_lock = threading.Lock()
_installed = False
_checked_generator = False


# -- Version check and the one-time install ---------------------------------------------------


def _release(version: str) -> tuple[int, ...]:
    """The leading numbers of a version string ("0.32.2.dev1" -> (0, 32, 2))."""
    match = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in match.group().split(".")) if match else ()


def installed_version() -> str:
    return importlib.metadata.version("mlx-lm")


def check_version(version: str | None = None) -> None:
    """Raise ``IncompatibleMlxLm`` when mlx-lm is outside ``TESTED`` (a warning instead with
    ``MLXCEL_UNTESTED_MLX_LM=1``)."""
    version = installed_version() if version is None else version
    first, below = TESTED
    if _release(first) <= _release(version) < _release(below):
        return
    message = (
        f"mlx-lm {version} is installed; mlxcel relies on mlx-lm internals tested with "
        f">={first},<{below} only. Install that range (pip install 'mlx-lm>={first},<{below}')"
    )
    if os.environ.get(UNTESTED_ENV) == "1":
        log.warning("%s. Going on because %s=1: check the output.", message, UNTESTED_ENV)
        return
    raise IncompatibleMlxLm(f"{message}, or set {UNTESTED_ENV}=1 to try it anyway.")


def install() -> None:
    """Check the mlx-lm version and install the ``BatchKVCache.extend`` patch; once per
    process, however often it is called (and from whichever thread)."""
    global _installed
    with _lock:
        if _installed:
            return
        check_version()
        missing = [
            f"{cls.__name__}.{name}"
            for cls, names in OVERRIDDEN.items()
            for name in names
            if not callable(getattr(cls, name, None))
        ]
        if not hasattr(BatchKVCache([0]), "_idx"):
            missing.append("BatchKVCache._idx")
        if missing:
            raise IncompatibleMlxLm(f"mlx-lm {installed_version()} lacks {', '.join(missing)}")
        BatchKVCache.extend = _extend  # type: ignore[method-assign]  # the patch, on purpose
        BatchKVCache.merge = classmethod(_merge)  # type: ignore[method-assign, assignment]  # the patch
        _installed = True


def check_generator(gen: Any) -> None:
    """Fail at start, not mid-request, when a generator lacks the internals we use."""
    global _checked_generator
    if _checked_generator:
        return
    missing = [f"BatchGenerator.{a}" for a in _GENERATOR_ATTRS if not hasattr(gen, a)]
    batch = getattr(gen, "_generation_batch", None)
    missing += [f"GenerationBatch.{a}" for a in _BATCH_ATTRS if not hasattr(batch, a)]
    if missing:
        raise IncompatibleMlxLm(f"mlx-lm {installed_version()} lacks {', '.join(missing)}")
    _checked_generator = True


# -- BatchGenerator's queues ------------------------------------------------------------------
# Rows wait in ``_unprocessed_sequences`` (tuples: uid, segments, max_tokens, cache, tokens in
# the cache, sampler, logits processors, stop sequences), are read in ``_prompt_batch``
# (``_currently_processing`` holds [segments left, read, total] per row), and decode in
# ``_generation_batch``.


def generation_batch(gen: Any) -> Any:
    return gen._generation_batch


def set_generation_batch(gen: Any, batch: Any) -> None:
    gen._generation_batch = batch


def prompt_batch(gen: Any) -> Any:
    return gen._prompt_batch


def set_prompt_batch(gen: Any, batch: Any) -> None:
    gen._prompt_batch = batch


def waiting(gen: Any) -> Any:
    """The deque of rows not yet reading (pop from its left to take one)."""
    return gen._unprocessed_sequences


def waiting_prompt(row: tuple[Any, ...]) -> tuple[int, list[list[int]]]:
    """A waiting row's uid and the segments of prompt it has left to read."""
    return row[0], row[1]


def prompt_batch_of(gen: Any, rows: list[tuple[Any, ...]]) -> Any:
    """A ``PromptProcessingBatch`` of waiting rows taken out of ``waiting`` (as mlx-lm's
    ``_make_batch`` builds, without recording them as being read)."""
    uids, _, max_tokens, caches, known, samplers, processors, stops = map(
        list, zip(*rows, strict=True)
    )
    return PromptProcessingBatch(
        gen.model,
        uids,
        caches,
        known,
        gen.prefill_step_size,
        samplers,
        gen.sampler,
        processors,
        stops,
        max_tokens,
    )


def reading(gen: Any) -> list[tuple[list[list[int]], int]]:
    """Per row of the prompt batch: the segments it has left to read, and its prompt length."""
    return [(seq[0], seq[2]) for seq in gen._currently_processing]


def set_reading(gen: Any, keep: Iterable[int]) -> None:
    """Keep only these rows (indices into ``reading``) as being read."""
    rows = gen._currently_processing
    gen._currently_processing = [rows[i] for i in keep]


def counters(gen: Any) -> Any:
    """The generator's running totals (``prompt_time``, ``prompt_tokens``, ``decode_time``,
    ``generation_tokens``, ``generation_steps``): the prefill budget reads and keeps them."""
    return gen._counters


def row_stages(gen: Any, uids: list[int]) -> dict[int, int]:
    """Where each row is: 0 waiting (nothing read), 1 reading its prompt, 2 generating."""
    return {uid: stage for uid, (stage, _) in gen._find_uids(uids).items()}


# -- A GenerationBatch's per-row state --------------------------------------------------------


def next_tokens(batch: Any) -> Any:
    """The tokens sampled in the last step (the next step's input), one per row."""
    return batch._next_tokens


def next_logprobs(batch: Any) -> list[Any]:
    return batch._next_logprobs  # type: ignore[no-any-return]  # mlx-lm is untyped


def set_next_logprobs(batch: Any, logprobs: list[Any]) -> None:
    batch._next_logprobs = logprobs


def set_next_tokens(batch: Any, tokens: Any) -> None:
    batch._next_tokens = tokens


def current_logprobs(batch: Any) -> list[Any]:
    """The distributions of the tokens the step just taken fed."""
    return batch._current_logprobs  # type: ignore[no-any-return]  # mlx-lm is untyped


def set_current(batch: Any, tokens: Any, logprobs: list[Any]) -> None:
    """What the step just taken fed and reported (mlx-lm keeps them for ``extend``)."""
    batch._current_tokens = tokens
    batch._current_logprobs = logprobs


def token_context(batch: Any, i: int) -> Any:
    """Row ``i``'s history as its logits processors see it (``update_and_fetch(tokens)``)."""
    return batch._token_context[i]


def row_counters(batch: Any) -> tuple[list[int], list[Any]]:
    """Per row, the tokens it has made, and its stop-sequence matcher (``advance(token)``)."""
    return batch._num_tokens, batch._matchers


def tokens_left(batch: Any, i: int) -> int:
    """How many tokens row ``i`` may still make."""
    return int(batch.max_tokens[i] - batch._num_tokens[i])


# -- A generation batch's rows, replaced in place (row reuse) ---------------------------------
# mlx-lm keeps a row's state in parallel lists (and one array of pending tokens); ``extend``
# appends to all of them and ``filter`` rebuilds them. Row reuse (``actors/model_runner/
# row_reuse.py``) instead puts a joining row where a finished one was.

_ROW_LISTS = ("uids", "tokens", "samplers", "logits_processors", "max_tokens", "stop_sequences")
_PRIVATE_ROW_LISTS = ("_next_logprobs", "_token_context", "_num_tokens", "_matchers")


def place_rows(batch: Any, rows: list[int], source: Any) -> None:
    """The first ``len(rows)`` rows of ``source`` (a generation batch) take the places of
    ``batch``'s rows ``rows``, for everything but the KV cache (``write_kv_rows``). The step's
    current tokens and distributions are not touched: the next step replaces them whole."""
    for name in _ROW_LISTS + _PRIVATE_ROW_LISTS:
        mine, theirs = getattr(batch, name), getattr(source, name)
        for row, value in zip(rows, theirs, strict=False):
            mine[row] = value
    pending = batch._next_tokens
    pending[mx.array(rows)] = source._next_tokens[: len(rows)].astype(pending.dtype)
    batch._next_tokens = pending


def kv_rows_fit(caches: list[Any], others: list[Any]) -> bool:
    """Whether ``others``' rows can be written into rows of ``caches`` in place: plain batch
    caches on both sides, every joining token at or left of the batch's write position."""
    if not rewindable(caches) or not rewindable(others) or len(caches) != len(others):
        return False
    return all(
        c.keys is not None
        and o.keys is not None
        and o._right_padding is None
        and o._idx <= c._idx
        and o.keys.dtype == c.keys.dtype
        for c, o in zip(caches, others, strict=True)
    )


def write_kv_rows(cache: Any, rows: list[int], other: Any) -> None:
    """Write ``other``'s first rows into ``cache``'s rows ``rows``, right-aligned at the
    batch's write position as ``extend`` aligns them. Positions left of a row's keys keep what
    the row's previous owner left there; its left padding masks them, as it masks the zeros
    ``extend`` writes. The buffer is written in place (mlx donates it: nothing else holds it,
    since prompt-cache entries are evaluated copies), so no other row is copied."""
    end, length = cache._idx, other._idx
    start = end - length
    for i, row in enumerate(rows):
        cache.keys[row : row + 1, :, start:end, :] = other.keys[i : i + 1, :, :length, :]
        cache.values[row : row + 1, :, start:end, :] = other.values[i : i + 1, :, :length, :]
    pads = cast(list[int], cache.left_padding.tolist())
    offsets = cast(list[int], cache.offset.tolist())
    their_pads = cast(list[int], other.left_padding.tolist())
    their_offsets = cast(list[int], other.offset.tolist())
    for i, row in enumerate(rows):
        pads[row] = their_pads[i] + start
        offsets[row] = their_offsets[i]
    cache.left_padding = mx.array(pads)
    cache.offset = mx.array(offsets)


def live_left_padding(caches: list[Any], rows: list[int]) -> int:
    """The least left padding among these rows of a plain batch cache (how many of its
    leading positions no listed row reads); 0 for any other cache."""
    if not rows or not rewindable(caches):
        return 0
    pads = cast(list[int], caches[0].left_padding.tolist())
    return min(pads[i] for i in rows)


# -- LRUPromptCache and the tokenizer wrapper -------------------------------------------------


def lru_exact(lru: Any, key: str, tokens: list[int]) -> list[Any] | None:
    """The entry stored for exactly these tokens (not a copy), or None."""
    if lru._trie.search(key, tokens).exact is None:
        return None
    return list(lru._trie.get(key, tokens).prompt_cache)


def lru_remove(lru: Any, key: str, tokens: list[int]) -> bool:
    """Drop the entry for exactly these tokens, as the LRU's own eviction does (it has no
    public removal)."""
    if lru._trie.search(key, tokens).exact is None:
        return False
    entry = lru._trie.pop(key, tokens)
    lru._lru.remove(key, tokens)
    lru._n_bytes -= entry.nbytes
    lru._n_bytes_by_type[entry.cache_type] -= entry.nbytes
    return True


def set_longrope(rope: Any, freqs: mx.array, scale: float | None) -> None:
    """Make a ``SuScaledRoPE`` divide by ``freqs`` (one per rotated pair) and, unless None,
    scale its rotated input by ``scale``, as its constructor does with ``long_factor``."""
    if not (hasattr(rope, "_freqs") and hasattr(rope, "_scale")):
        raise IncompatibleMlxLm(f"mlx-lm {installed_version()} lacks SuScaledRoPE._freqs/_scale")
    if rope._freqs.shape != freqs.shape:
        raise ValueError(f"{freqs.shape[0]} LongRoPE frequencies for {rope._freqs.shape[0]}")
    rope._freqs = freqs
    if scale is not None:
        rope._scale = scale


def tokenizer_of(wrapper: Any) -> Any:
    """The transformers tokenizer inside mlx-lm's ``TokenizerWrapper`` (no public accessor)."""
    return wrapper._tokenizer


# -- The model's attention and SwiGLU ---------------------------------------------------------


def swap_model_functions(
    model: Any, wraps: dict[str, Callable[[Callable[..., Any]], Callable[..., Any]]]
) -> list[str]:
    """Replace mlx-lm functions (``scaled_dot_product_attention``, ``swiglu``) by ``wrap(own)``
    in the ``mlx_lm.models`` modules that ``model``'s classes come from; returns what changed.

    Only names that still hold mlx-lm's own function change, so a second call changes nothing.
    """
    install()
    from mlx_lm.models import activations, base

    originals = {
        "scaled_dot_product_attention": base.scaled_dot_product_attention,
        "swiglu": activations.swiglu,
    }
    names = {type(m).__module__ for _, m in model.named_modules()} | {type(model).__module__}
    swapped = []
    for name in sorted(names):
        module = sys.modules.get(name)
        if module is None or not name.startswith("mlx_lm.models."):
            continue
        for attr, wrap in wraps.items():
            original = originals[attr]
            if getattr(module, attr, None) is original:
                setattr(module, attr, wrap(original))
                swapped.append(f"{name}.{attr}")
    return swapped


# -- BatchKVCache.extend, copying the batch once ----------------------------------------------
# A row joining the running batch. The batch's rows are right-aligned at the write position.
# When the joining row holds more tokens than the batch (a long conversation joining shorter
# ones, a common case for realtime turns), mlx-lm pads the whole batch on the left with
# ``mx.pad`` and then concatenates it with the newcomer: every running row's cache is copied
# twice. Measured here, 8 rows x ~920 tokens on SmolLM2-135M: 0.32-0.45 s for such a join
# against 0.11 s when the batch needs no padding. This version writes both parts once into one
# new buffer, and only the positions that hold tokens. When the batch needs no padding,
# mlx-lm's concatenate (one copy) is kept: it is faster than filling a fresh buffer.

# (Through ``__wrapped__``: this module imported again must not wrap its own patch.)
_ORIGINAL_EXTEND: Callable[[Any, Any], None] = getattr(
    BatchKVCache.extend, "__wrapped__", BatchKVCache.extend
)


def _extend(self: Any, other: Any) -> None:
    if self.keys is None or other.keys is None:
        _ORIGINAL_EXTEND(self, other)
        return
    end = max(self._idx, other._idx)
    size = max(self.keys.shape[2], other.keys.shape[2])
    if self._idx == end and self.keys.shape[2] == size:
        _ORIGINAL_EXTEND(self, other)
        return
    b1, heads, _, dk = self.keys.shape
    b2, dv = other.keys.shape[0], self.values.shape[3]
    keys = mx.zeros((b1 + b2, heads, size, dk), dtype=self.keys.dtype)
    values = mx.zeros((b1 + b2, heads, size, dv), dtype=self.values.dtype)
    left_padding, offsets = [], []
    for first, cache in ((0, self), (b1, other)):
        rows = slice(first, first + cache.keys.shape[0])
        # Right-aligned at `end`: tokens [0, _idx) of this cache go to [end - _idx, end).
        keys[rows, :, end - cache._idx : end] = cache.keys[..., : cache._idx, :]
        values[rows, :, end - cache._idx : end] = cache.values[..., : cache._idx, :]
        left_padding.append(cache.left_padding + (end - cache._idx))
        offsets.append(cache.offset)
    self.keys, self.values = keys, values
    self.left_padding = mx.concatenate(left_padding)
    self.offset = mx.concatenate(offsets)
    self._idx = end


_extend.__wrapped__ = _ORIGINAL_EXTEND  # type: ignore[attr-defined]  # as functools.wraps


# -- BatchKVCache.merge, keeping a row's position shift ---------------------------------------
# A vision-language row read with M-RoPE sits at "length + shift" (models/vlm.py): its layer
# caches say so in an attribute, and the batch cache they merge into carries the shift in the
# row's offset (the position its next token takes; a batch cache uses offset for no other
# purpose). Rows without the attribute merge exactly as in mlx-lm.

_ORIGINAL_MERGE: Callable[[list[Any]], Any] = getattr(
    BatchKVCache.merge, "__wrapped__", BatchKVCache.merge
)
POSITION_SHIFT = "position_shift"


def _merge(cls: Any, caches: list[Any]) -> Any:
    merged = _ORIGINAL_MERGE(caches)
    shifts = [int(getattr(c, POSITION_SHIFT, 0)) for c in caches]
    if any(shifts):
        merged.offset = merged.offset + mx.array(shifts)
    return merged


_merge.__wrapped__ = _ORIGINAL_MERGE  # type: ignore[attr-defined]  # as functools.wraps


def batch_left_padding(cache: Any) -> list[int] | None:
    """Per row, the left padding of a plain ``BatchKVCache`` (not its rotating or quantised
    kinds, whose key slices are not a row's own keys); None for any other cache."""
    if type(cache) is not BatchKVCache:
        return None
    padding: mx.array = cache.left_padding
    return [int(p) for p in cast(list[int], padding.tolist())]


def rewindable(caches: list[Any]) -> bool:
    """Whether ``rewind_rows`` can take tokens back from these layer caches: plain batch
    caches only (a rotating cache has overwritten what it would restore, and a state-space
    layer's state cannot be rewound)."""
    return bool(caches) and all(type(c) is BatchKVCache for c in caches)


def rewind_rows(caches: list[Any], rejected: list[int]) -> None:
    """Drop each row's last ``rejected[i]`` tokens from every layer's batch cache.

    The tokens all rows drop are trimmed off the end (free); a row that drops more than the
    fewest is rolled right by the difference and that much left padding added, which is what
    ``BatchKVCache.finalize`` does for a right-padded prompt (one copy of the layer's cache).
    """
    least = min(rejected)
    extra = [r - least for r in rejected]
    rolled = any(extra)
    for c in caches:
        if least:
            c.trim(least)
        if rolled:
            c._right_padding = mx.array(extra)
            c.finalize()
