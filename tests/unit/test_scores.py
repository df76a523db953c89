"""The generation batch hands out unnormalised scores (eager_start's ``_decode``): a request that
asks for log-probabilities still gets the model's true ones, greedy or sampled, beside rows of
other kinds."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import mlxcel.models  # noqa: F401  isort: skip  (OpenBLAS before mlx)

import pytest

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.models.mlx_setup import mx
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan
from mlxcel.runtime.settings import Settings

PROMPT = (7, 8, 9, 10, 11, 12)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


def _reference(loaded: Any, tokens: list[int]) -> mx.array:
    """The log-softmax of the model's next-token logits after ``tokens``, alone."""
    from mlx_lm.models.cache import make_prompt_cache

    logits = loaded.model(mx.array([tokens]), cache=make_prompt_cache(loaded.model))[0, -1]
    return logits - mx.logsumexp(logits)


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_log_probabilities_are_normalised_whatever_the_batch_holds(
    loaded: Any, temperature: float
) -> None:
    backend = MlxBackend(loaded, Settings(parallel=4, cache_ram_mib=0, spec_ngram=False))
    asked = SamplingParams(temperature=temperature, seed=3 if temperature else None)
    inserts = (
        InsertSequence("lp", PROMPT, 6, asked, logprobs=4, ignore_eos=True),
        # Beside it: a greedy row and a sampled one, so the batch takes both paths.
        InsertSequence("g", (3, 4, 5), 6, SamplingParams(temperature=0.0), ignore_eos=True),
        InsertSequence("t", (5, 4), 6, SamplingParams(temperature=1.2, top_p=0.9), ignore_eos=True),
    )
    said: list[Any] = []
    plan = StepPlan(inserts=inserts)
    for _ in range(40):
        out = backend.apply(plan)
        plan = StepPlan()
        said += [t for t in out.tokens if t.request_id == "lp"]
        if len(said) == 6:
            break
    assert len(said) == 6
    history = list(PROMPT)
    for t in said:
        want = _reference(loaded, history)
        assert t.logprob == pytest.approx(want[t.token].item(), abs=2e-4)
        top = dict(t.top_logprobs)
        assert len(top) == 4
        assert sum(math.exp(v) for v in top.values()) <= 1 + 1e-4
        for token, value in top.items():
            assert value == pytest.approx(want[token].item(), abs=2e-4)
        history.append(t.token)
