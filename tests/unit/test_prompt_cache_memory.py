"""The prompt cache holds what it counts, and an idle server gives mlx's freed buffers back
(real MLX backend, tiny random llama, batched traffic: the case that leaked ~60 MB an entry on
the default model while ~2 MB were counted)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import BatchKVCache

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.actors.model_runner.prompt_cache import PromptCache
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepOutput, StepPlan
from mlxcel.runtime.settings import Settings

GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


def _held_since(before: int) -> int:
    gc.collect()
    return mx.get_active_memory() - before


def test_an_entry_taken_from_a_wide_batch_holds_only_its_row() -> None:
    cache = PromptCache(1 << 30)
    before = mx.get_active_memory()
    for n in range(4):
        layers = []
        for _ in range(3):
            batch = BatchKVCache([0] * 8)
            keys = mx.random.normal((8, 2, 300, 32))
            batch.update_and_fetch(keys, keys)
            mx.eval(batch.keys, batch.values)
            layers.append(batch)
        # What the backend stores for a finished row: the row's slice of the batch.
        cache.store("tenant", list(range(n * 1000, n * 1000 + 300)), [b.extract(3) for b in layers])
        del layers, batch, keys
    held = _held_since(before)
    # 4 entries x 3 layers x (keys + values) x 2 heads x 300 tokens x 32 x 4 bytes.
    assert cache.stats().nbytes == 4 * 3 * 2 * 2 * 300 * 32 * 4
    # The batches (8 rows, room for 512 tokens: ~14x more) are gone, not kept by the entries.
    assert held == pytest.approx(cache.stats().nbytes, rel=0.02)


def _wave(b: MlxBackend, wave: int) -> StepOutput:
    """Eight requests at once, finishing at different steps (rows leave a wide batch); the
    output of the step that finished the last one."""
    starts = [100 + 300 * wave + 37 * i for i in range(8)]
    plan = StepPlan(
        inserts=tuple(
            InsertSequence(f"{wave}-{i}", tuple(range(s, s + 60)), 12 + i, GREEDY, cache_key="t")
            for i, s in enumerate(starts)
        )
    )
    done = 0
    while True:
        out = b.apply(plan)
        plan = StepPlan()
        done += sum(1 for t in out.tokens if t.finish_reason)
        if done == len(starts):
            return out


def test_batched_traffic_leaves_memory_as_counted_and_frees_the_rest_when_idle(
    loaded: Any,
) -> None:
    b = MlxBackend(loaded, Settings(parallel=8, cache_ram_mib=64, prefill_chunk_size=16))
    warm = _wave(b, 0)  # first use: whatever the model and samplers keep once made
    assert warm.cache is not None
    before = mx.get_active_memory()
    for wave in (1, 2, 3):
        out = _wave(b, wave)
    # No idle step follows (the scheduler sends none to an empty batch): the step that
    # finished the last row gave the memory back.
    assert out.cache is not None
    assert out.cache.entries == 32
    # What stayed alive since is the new prompt-cache entries, as counted (it was ~14x more).
    grown = out.cache.nbytes - warm.cache.nbytes
    assert _held_since(before) == pytest.approx(grown, rel=0.05)
    assert out.cache.mlx_active == mx.get_active_memory()
    # Idle: mlx's allocator has handed its freed buffers back.
    assert out.cache.mlx_cached == 0 == mx.get_cache_memory()
