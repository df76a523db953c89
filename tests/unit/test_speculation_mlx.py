"""N-gram speculation on the real MLX backend (tiny random llama): with proposals checked every
step, every request gets the tokens, finish reasons and log-probabilities it gets without
speculation, whatever else runs beside it (choices, penalties, logprobs, token limits)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.actors.model_runner.speculation import Choice, StepCosts
from mlxcel.runtime.messages import InsertSequence
from mlxcel.runtime.settings import Settings
from tests.support.drive import GREEDY, LOOP, drive, mixed_requests


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


class Always:
    """Speculate every step that has a proposal, this far."""

    def __init__(self, width: int) -> None:
        self.width = self.max_tokens = width
        self.costs = StepCosts()

    def worth_looking(self, rows: int, stats: list[Any]) -> bool:
        return True

    def choose(self, rows: int, proposals: list[Any]) -> Choice:
        return Choice(self.width if proposals else 0, 2.0)


def _run(
    loaded: Any,
    inserts: list[InsertSequence],
    *,
    spec: bool,
    width: int = 4,
    setup: Any = None,
) -> tuple[dict[tuple[str, int], list[Any]], dict[tuple[str, int], str], int, int]:
    """Tokens (with log-probabilities) and finish reasons per (request, choice), and the
    tokens proposed and accepted over the run."""
    backend = MlxBackend(
        loaded, Settings(parallel=8, cache_ram_mib=0, prefill_chunk_size=16, spec_ngram=spec)
    )
    if setup is not None:
        setup(backend)
    elif spec:
        assert backend._spec is not None
        backend._spec.policy = Always(width)  # type: ignore[assignment]  # a test double
    # The others join while the first decodes: rows join a batch that speculates.
    run = drive(backend, inserts, join_every=3)
    return run.tokens, run.finish, run.proposed, run.accepted


@pytest.fixture(scope="module")
def echo(loaded: Any) -> tuple[int, ...]:
    """A prompt that holds the model's own continuation of ``LOOP`` (with two tokens changed)
    and then ``LOOP`` again: a row reading it has a long proposal that is mostly right."""
    first, _, _, _ = _run(
        loaded, [InsertSequence("c", LOOP, 40, GREEDY, ignore_eos=True)], spec=False
    )
    said = [t for t, _, _ in first["c", 0]]
    said[12], said[30] = 11, 12
    return LOOP + tuple(said) + LOOP


def _inserts(echo: tuple[int, ...]) -> list[InsertSequence]:
    # "pen" (a logits processor) rides along without speculating.
    return [
        InsertSequence("copy", echo, 48, GREEDY, ignore_eos=True),
        *mixed_requests(),
        InsertSequence("eos", (1, 2, 3) * 5, 60, GREEDY),
    ]


@pytest.mark.parametrize("width", [2, 8])
def test_speculation_changes_no_token(loaded: Any, echo: tuple[int, ...], width: int) -> None:
    plain, plain_finish, p0, _ = _run(loaded, _inserts(echo), spec=False)
    spec, spec_finish, proposed, accepted = _run(loaded, _inserts(echo), spec=True, width=width)
    assert p0 == 0
    # Speculation happened, and both of its outcomes did.
    assert accepted >= 20 and proposed - accepted >= 2, (proposed, accepted)
    assert spec_finish == plain_finish
    assert len(spec[("short", 0)]) == 3 and spec_finish["short", 0] == "length"
    for key, rows in plain.items():
        assert [t for t, _, _ in spec[key]] == [t for t, _, _ in rows], key
    for (_, lp, top), (_, lp0, top0) in zip(spec["lp", 0], plain["lp", 0], strict=True):
        assert lp == pytest.approx(lp0, abs=1e-4)
        assert [i for i, _ in top] == [i for i, _ in top0]


def test_off_reports_no_drafts_and_settings_turn_it_off(loaded: Any) -> None:
    for settings in (
        Settings(spec_ngram=False),
        Settings(spec_ngram_max=0),
        Settings(batch_invariant=True, parallel=2),
        Settings(context_shift=True),
    ):
        assert not settings.speculating
        assert MlxBackend(loaded, settings)._spec is None
    assert Settings().speculating


def test_a_draft_model_changes_no_token_and_its_own_copy_is_accepted(
    loaded: Any, echo: tuple[int, ...]
) -> None:
    """The tiny model drafting for itself: every proposal is what the model would say, so
    nearly all are accepted, and the tokens are those of the plain run."""
    from mlxcel.actors.model_runner.draft import DraftModel
    from mlxcel.actors.model_runner.speculative_batch import Speculation

    plain, plain_finish, _, _ = _run(loaded, _inserts(echo), spec=False)

    def drafting(backend: MlxBackend) -> None:
        spec = Speculation(4, 2048, DraftModel(loaded.model, p_min=0.0, min_tokens=0))
        spec.policy = Always(4)  # type: ignore[assignment]  # a test double
        backend._gen._generation_batch.speculation = spec
        backend._spec = spec

    spec, spec_finish, proposed, accepted = _run(loaded, _inserts(echo), spec=True, setup=drafting)
    assert spec_finish == plain_finish
    for key, rows in plain.items():
        assert [t for t, _, _ in spec[key]] == [t for t, _, _ in rows], key
    assert proposed > 100 and accepted >= 0.95 * proposed, (proposed, accepted)


def test_a_draft_with_another_vocabulary_is_refused_at_start(loaded: Any) -> None:
    import attrs

    class Other:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

    other = attrs.evolve(loaded, tokenizer=Other())
    with pytest.raises(RuntimeError, match="its tokenizer is not the model's"):
        MlxBackend(loaded, Settings(model_draft="other"), other)
