"""The eager-start batch generator on the tiny random llama: a row joining running rows gets
its first token a step sooner than with mlx-lm's own generator, costs no model pass of its
own, and every token (samplers, processors, stop sequences, limits) is the same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator, StopSequences
from mlx_lm.sample_utils import make_logits_processors

from mlxcel.actors.model_runner.eager_start import EagerStartBatchGenerator

KWARGS = {"max_tokens": 64, "completion_batch_size": 8, "prefill_step_size": 64}


@pytest.fixture(scope="module")
def model(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir))).model


class Counting:
    """The model, counting its passes (a pass is one call, whatever its rows)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.calls = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def _run(
    gen: BatchGenerator, joins: list[tuple[list[int], int]], **insert: Any
) -> tuple[dict[int, list[int]], list[int], dict[int, str]]:
    """Two rows decode; from step 4 on, one of ``joins`` (prompt, max_tokens) joins every
    other step. Returns every row's tokens, each joiner's steps from insert to first token,
    and the finish reasons."""
    tokens: dict[int, list[int]] = {}
    finish: dict[int, str] = {}
    waits: list[int] = []
    uids = gen.insert([list(range(100, 140)), list(range(200, 230))], max_tokens=[24, 24], **insert)
    tokens.update({uid: [] for uid in uids})
    pending: dict[int, int] = {}
    todo = list(joins)
    for step in range(300):
        if step >= 4 and step % 2 == 0 and todo:
            prompt, limit = todo.pop(0)
            (uid,) = gen.insert(
                [prompt], max_tokens=[limit], **{k: v[:1] for k, v in insert.items()}
            )
            tokens[uid] = []
            pending[uid] = step
        _, generated = gen.next()
        for r in generated:
            tokens[r.uid].append(r.token)
            if r.finish_reason:
                finish[r.uid] = r.finish_reason
            if r.uid in pending:
                waits.append(step - pending.pop(r.uid) + 1)
        if not todo and not pending and len(finish) == len(tokens):
            break
    return tokens, waits, finish


JOINS = [(list(range(300 + 30 * k, 330 + 30 * k)), 8) for k in range(3)]


def test_a_joining_row_starts_a_step_sooner_with_no_pass_of_its_own(model: Any) -> None:
    plain_model, eager_model = Counting(model), Counting(model)
    plain = _run(BatchGenerator(plain_model, **KWARGS), JOINS)
    eager = _run(EagerStartBatchGenerator(eager_model, hold=lambda uid: False, **KWARGS), JOINS)
    assert plain[1] == [3, 3, 3]  # read, first pass alone, first token out
    assert eager[1] == [2, 2, 2]  # read, first token out of the next batch step
    assert eager[0] == plain[0] and eager[2] == plain[2]
    assert all(len(t) in (8, 24) for t in eager[0].values())
    # mlx-lm runs each of the 3 joiners through the model alone once more, besides the batch
    # steps; the eager generator does not. (The first two rows start into an empty batch,
    # where mlx-lm's lone pass and the eager batch step are the same one pass.)
    assert eager_model.calls == plain_model.calls - 3


def test_one_token_prompts_and_one_token_answers(model: Any) -> None:
    # An exact prompt-cache hit leaves one token to read; a max_tokens=1 answer ends at once.
    joins = [([7], 5), (list(range(50, 70)), 1), ([9], 1)]
    plain = _run(BatchGenerator(model, **KWARGS), joins)
    eager = _run(EagerStartBatchGenerator(model, hold=lambda uid: False, **KWARGS), joins)
    assert plain[1] == [2, 3, 2]
    assert eager[1] == [1, 2, 1]  # joins before this step's decode, its token comes out of it
    assert eager[0] == plain[0] and eager[2] == plain[2]
    assert [len(eager[0][uid]) for uid in (2, 3, 4)] == [5, 1, 1]


def test_processors_and_stop_sequences_see_the_same_tokens(model: Any) -> None:
    # A repetition penalty reads the whole prompt; the stop sequence is one of the first
    # tokens the greedy plain run produced, so some rows end with "stop".
    probe = _run(BatchGenerator(model, **KWARGS), JOINS)[0]
    stop = probe[2][2]
    insert = {
        "logits_processors": [make_logits_processors(repetition_penalty=1.5)] * 2,
        "stop_sequences": [StopSequences([[stop]])] * 2,
    }
    plain = _run(BatchGenerator(model, **KWARGS), JOINS, **insert)
    eager = _run(EagerStartBatchGenerator(model, hold=lambda uid: False, **KWARGS), JOINS, **insert)
    assert eager == (plain[0], [2, 2, 2], plain[2])
    assert "stop" in plain[2].values()


def test_held_rows_keep_mlx_lm_pace(model: Any) -> None:
    _, waits, _ = _run(EagerStartBatchGenerator(model, hold=lambda uid: True, **KWARGS), JOINS)
    assert waits == [3, 3, 3]
