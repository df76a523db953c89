"""A cancelled request donates the KV cache of what it has read to the prompt cache, as a
finished one does (real MLX backend, tiny random llama). A realtime turn cut off by the next
question is that question's prefix; without the donation the next turn reads it again."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepOutput, StepPlan
from mlxcel.runtime.settings import Settings

GREEDY = SamplingParams(temperature=0.0)
PROMPT = tuple(range(100, 140))  # 40 tokens: five prefill chunks of 8
KEY = "tenant"


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


def backend(loaded: Any) -> MlxBackend:
    return MlxBackend(loaded, Settings(parallel=4, cache_ram_mib=64, prefill_chunk_size=8))


def insert(rid: str, prompt: tuple[int, ...], max_tokens: int = 8) -> StepPlan:
    seq = InsertSequence(rid, prompt, max_tokens, GREEDY, cache_key=KEY)
    return StepPlan(inserts=(seq,))


def answer(b: MlxBackend, plan: StepPlan) -> tuple[int, list[int]]:
    """Run ``plan`` to the end: prompt tokens found in the cache, and the tokens generated."""
    cached, tokens = 0, []
    while True:
        out: StepOutput = b.apply(plan)
        plan = StepPlan()
        cached += sum(n for _, n in out.cached)
        tokens += [t.token for t in out.tokens]
        if any(t.finish_reason for t in out.tokens):
            return cached, tokens


def test_a_request_cancelled_while_generating_is_the_next_prompts_prefix(loaded: Any) -> None:
    b = backend(loaded)
    plan, said = insert("a", PROMPT, max_tokens=50), []
    while len(said) < 4:  # cut off after a few tokens, like a barge-in
        said += [t.token for t in b.apply(plan).tokens]
        plan = StepPlan()
    b.apply(StepPlan(removes=("a",)))
    # The next turn: the question, what was said of the answer, and more.
    follow = PROMPT + tuple(said) + tuple(range(200, 210))
    cached, tokens = answer(b, insert("b", follow))
    # Everything read before the cut is found again: the prompt and every token handed out
    # (a step hands out the tokens it reads).
    assert cached == len(PROMPT) + len(said)
    # ...and the answer is what a cold cache gives.
    assert tokens == answer(backend(loaded), insert("b", follow))[1]


def test_a_request_cancelled_while_reading_its_prompt_keeps_what_it_read(loaded: Any) -> None:
    b = backend(loaded)
    b.apply(insert("a", PROMPT))
    b.apply(StepPlan())  # two chunks of 8 read
    b.apply(StepPlan(removes=("a",)))
    cached, tokens = answer(b, insert("b", PROMPT))
    assert cached == 16
    assert tokens == answer(backend(loaded), insert("b", PROMPT))[1]


def test_without_a_cache_key_nothing_is_donated(loaded: Any) -> None:
    b = backend(loaded)
    b.apply(StepPlan(inserts=(InsertSequence("a", PROMPT, 50, GREEDY),)))
    b.apply(StepPlan())
    b.apply(StepPlan(removes=("a",)))
    assert answer(b, insert("b", PROMPT))[0] == 0
