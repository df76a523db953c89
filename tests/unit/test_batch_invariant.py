"""--batch-invariant on the real MLX backend (tiny random llama): a seeded row's tokens and
log-probabilities are bit for bit those it has alone, whatever joins the batch around it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxcel.actors.model_runner import invariance
from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.runtime.messages import InsertSequence, SamplingParams
from mlxcel.runtime.settings import Settings
from tests.support.drive import drive_schedule

PARALLEL = 8


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


def seq(rid: str, start: int, length: int, seed: int | None) -> InsertSequence:
    sampling = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=seed)
    prompt = tuple(range(start, start + length))
    return InsertSequence(rid, prompt, 12, sampling, logprobs=0, cache_key="")


def run(loaded: Any, schedule: list[tuple[int, InsertSequence]]) -> dict[str, list[Any]]:
    """Insert each sequence at its step; every row's (token, log-probability) in order."""
    settings = Settings(
        parallel=PARALLEL, prefill_chunk_size=8, cache_ram_mib=64, batch_invariant=True
    )
    return drive_schedule(MlxBackend(loaded, settings), schedule)


def test_a_seeded_row_computes_as_it_would_alone(loaded: Any) -> None:
    seeds = range(7, 13)
    solo = {s: run(loaded, [(0, seq("alone", 40 + 3 * s, 5 + 4 * s, s))])["alone"] for s in seeds}
    schedule = []
    for i, s in enumerate(seeds):
        # Seeded rows join at different steps, beside unseeded ones of other lengths: every
        # row sits behind a different left padding each time the batch changes.
        schedule.append((2 * i, seq(f"seeded{s}", 40 + 3 * s, 5 + 4 * s, s)))
        schedule.append((i, seq(f"other{i}", 300 + i, 3 + 11 * i, None)))
    together = run(loaded, schedule)
    for s in seeds:
        assert together[f"seeded{s}"] == solo[s], s
    # A second run of one of them reads its prompt whole again (a cached prefix would have
    # been computed in other chunks) and still matches.
    again = run(loaded, [(0, seq("a", 61, 33, 7)), (1, seq("b", 61, 33, 7))])
    assert again["a"] == again["b"] == solo[7]


def test_layers_give_each_decode_row_its_bits_alone(loaded: Any) -> None:
    """Padded to a row-invariant count where this machine's BLAS has one, else one row at a
    time: a decode batch's row has the bits it has alone, at every count and place."""
    assert invariance.prepare(loaded.model, PARALLEL) is None
    assert invariance.prepare(loaded.model, PARALLEL) is None  # twice is harmless
    for name, module in loaded.model.named_modules():
        if invariance._kind(module) != "linear":
            continue
        x = mx.random.normal((PARALLEL, 1, invariance._width(module)), key=mx.random.key(1))
        full = module(x)
        for m in range(1, PARALLEL + 1):
            assert mx.array_equal(module(x[:m]), full[:m]).item(), (name, m)
            assert mx.array_equal(module(x[m - 1 : m]), full[m - 1 : m]).item(), (name, m)
        # Leading dimensions (batch, tokens) keep their shape.
        assert module(x[:3]).shape == (3, 1, full.shape[-1])
