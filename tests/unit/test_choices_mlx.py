"""n choices on the real MLX backend (tiny random llama): the prompt's KV cache is computed
once and forked, and the forked rows decode exactly as a lone request would."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.runtime.messages import InsertSequence, SamplingParams, StepPlan
from mlxcel.runtime.settings import Settings

GREEDY = SamplingParams(temperature=0.0)
PROMPT = tuple(range(100, 140))  # 40 tokens: five prefill chunks of 8


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


class Run:
    """A backend driven step by step, recording tokens per (request, choice)."""

    def __init__(self, loaded: Any, *, cache_mib: int = 0, parallel: int = 6) -> None:
        settings = Settings(parallel=parallel, cache_ram_mib=cache_mib, prefill_chunk_size=8)
        self.backend = MlxBackend(loaded, settings)
        self.tokens: dict[tuple[str, int], list[int]] = {}
        self.finish: dict[tuple[str, int], str] = {}

    def steps(self, plan: StepPlan) -> Iterator[int]:
        """Apply ``plan``, then empty plans until nothing runs; yields the step number."""
        step = 0
        while True:
            out = self.backend.apply(plan)
            plan = StepPlan()
            for t in out.tokens:
                self.tokens.setdefault((t.request_id, t.choice), []).append(t.token)
                if t.finish_reason is not None:
                    self.finish[t.request_id, t.choice] = t.finish_reason
            yield step
            step += 1
            if not self.backend._rid_by_uid:
                return

    def run(self, *inserts: InsertSequence) -> Any:
        # mlx-lm's own counters: prompt tokens the model actually read, decode steps taken.
        with self.backend._gen.stats() as stats:
            for _ in self.steps(StepPlan(inserts=inserts)):
                pass
        return stats


def test_n_choices_read_the_prompt_once_and_decode_like_one(loaded: Any) -> None:
    single = Run(loaded)
    one = single.run(InsertSequence("a", PROMPT, 6, GREEDY))
    multi = Run(loaded)
    three = multi.run(InsertSequence("a", PROMPT, 6, GREEDY, n=3))
    # All but the last prompt token go through the model once; each row feeds the last itself.
    assert one.prompt_tokens == three.prompt_tokens == len(PROMPT) - 1
    # Greedy choices from the forked cache are exactly the lone request's answer...
    assert [multi.tokens["a", i] for i in range(3)] == [single.tokens["a", 0]] * 3
    # ...decoded side by side: as many steps as one answer, three times the tokens.
    assert three.generation_steps == one.generation_steps
    assert three.generation_tokens == 3 * one.generation_tokens


def test_seeded_choice_i_draws_from_seed_plus_i(loaded: Any) -> None:
    def seeded(seed: int) -> SamplingParams:
        return SamplingParams(temperature=1.0, seed=seed)

    first, again, lone = Run(loaded), Run(loaded), Run(loaded)
    first.run(InsertSequence("a", PROMPT, 8, seeded(7), n=3))
    again.run(InsertSequence("a", PROMPT, 8, seeded(7), n=3))
    lone.run(*(InsertSequence(f"s{i}", PROMPT, 8, seeded(7 + i)) for i in range(3)))
    assert first.tokens == again.tokens
    assert [first.tokens["a", i] for i in range(3)] == [lone.tokens[f"s{i}", 0] for i in range(3)]
    assert len({tuple(first.tokens["a", i]) for i in range(3)}) == 3


def test_a_prompt_cache_hit_forks_from_the_cached_prefix(loaded: Any) -> None:
    run = Run(loaded, cache_mib=64)
    cold = run.run(InsertSequence("cold", PROMPT, 5, GREEDY, cache_key="", n=2))
    warm = run.run(InsertSequence("warm", PROMPT, 5, GREEDY, cache_key="", n=2))
    assert cold.prompt_tokens == len(PROMPT) - 1 and warm.prompt_tokens == 0
    assert run.tokens["warm", 0] == run.tokens["warm", 1] == run.tokens["cold", 0]


def test_choices_in_a_mixed_batch_match_lone_requests(loaded: Any) -> None:
    prompts = {"a": PROMPT, "b": tuple(range(200, 251)), "c": tuple(range(300, 311))}
    lone = Run(loaded)
    lone.run(*(InsertSequence(k, p, 8, GREEDY) for k, p in prompts.items()))
    mixed = Run(loaded)
    first = StepPlan(
        inserts=(
            InsertSequence("a", prompts["a"], 8, GREEDY, n=3),
            InsertSequence("b", prompts["b"], 8, GREEDY),
        )
    )
    for step in mixed.steps(first):
        if step == 2:  # c arrives while a and b are still reading their prompts
            late = InsertSequence("c", prompts["c"], 8, GREEDY, n=2)
            for _ in mixed.steps(StepPlan(inserts=(late,))):
                pass
            break
    assert sorted(mixed.tokens) == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("c", 0), ("c", 1)]
    for (rid, _), tokens in mixed.tokens.items():
        assert tokens == lone.tokens[rid, 0], rid


def test_stopping_one_choice_and_removing_a_request_mid_prefill(loaded: Any) -> None:
    run = Run(loaded)
    steps = run.steps(
        StepPlan(
            inserts=(
                InsertSequence("a", PROMPT, 30, GREEDY, n=2),
                InsertSequence("b", PROMPT * 3, 30, GREEDY, n=3),
            )
        )
    )
    for _ in steps:
        if len(run.tokens.get(("a", 0), ())) == 2:
            break
    # a's choice 1 stops (a stop string matched) and b leaves while still reading its prompt.
    for _ in run.steps(StepPlan(removes=("b",), stop_choices=(("a", 1),))):
        pass
    assert run.finish == {("a", 0): "length"}
    assert len(run.tokens["a", 0]) == 30 and len(run.tokens["a", 1]) == 2
    assert not any(rid == "b" for rid, _ in run.tokens)
    assert not run.backend._forks and not run.backend._uids_by_rid
