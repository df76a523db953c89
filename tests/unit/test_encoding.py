"""Decode steps queued from the encoder's thread (``model_runner.encoding``) on the real MLX
backend: every request gets the tokens, finish reasons and log-probabilities it gets with the
steps queued from the runner's own thread, through rows joining, finishing, forking, reading
long prompts in chunks, grammars, penalties and seeded sampling; and the thread and its stream
go back when the backend closes."""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxcel.actors.grammars import schema_grammar
from mlxcel.actors.model_runner import encoding
from mlxcel.actors.model_runner.encoding import Encoder
from mlxcel.actors.model_runner.mlx_backend import MlxBackend
from mlxcel.runtime.messages import InsertSequence, SamplingParams
from mlxcel.runtime.settings import Settings
from tests.support.drive import GREEDY, LOOP, drive, mixed_requests

_INTEGERS = schema_grammar(json.dumps({"type": "array", "items": {"type": "integer"}}))


@pytest.fixture(scope="module")
def loaded(tiny_model_dir: Path) -> Any:
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    return load_model(resolve_model(str(tiny_model_dir)))


def _inserts() -> list[InsertSequence]:
    return [
        InsertSequence("plain", (3, 4, 5, 6), 40, GREEDY, ignore_eos=True),
        *mixed_requests(),
        InsertSequence("seeded", LOOP, 25, SamplingParams(seed=7), ignore_eos=True),
        InsertSequence("long", tuple(range(3, 90)), 10, GREEDY, ignore_eos=True),
        InsertSequence("json", (1, 5, 9), 12, GREEDY, ignore_eos=True, grammar=_INTEGERS),
    ]


def _run(loaded: Any, monkeypatch: pytest.MonkeyPatch, *, thread: bool, spec: bool) -> Any:
    """Every request's tokens (with log-probabilities) and finish reasons; rows join while
    others decode, on a thread of its own as the model runner's."""
    monkeypatch.setenv("MLXCEL_ENCODER_THREAD", "1" if thread else "0")
    result: dict[str, Any] = {}

    def body() -> None:
        backend = MlxBackend(
            loaded, Settings(parallel=6, cache_ram_mib=0, prefill_chunk_size=16, spec_ngram=spec)
        )
        assert (backend._encoder is not None) == thread
        run = drive(backend, _inserts(), join_every=4)
        backend.close()
        result["out"] = run.tokens, run.finish, run.errors

    runner = threading.Thread(target=body)
    runner.start()
    runner.join()
    return result["out"]


@pytest.mark.parametrize("spec", [False, True])
def test_steps_queued_from_the_encoder_thread_change_no_token(
    loaded: Any, monkeypatch: pytest.MonkeyPatch, spec: bool
) -> None:
    plain, plain_finish, plain_errors = _run(loaded, monkeypatch, thread=False, spec=spec)
    threaded, threaded_finish, threaded_errors = _run(loaded, monkeypatch, thread=True, spec=spec)
    assert threaded_finish == plain_finish and threaded_errors == plain_errors
    # Every request (both choices of "two") finished or failed by its grammar.
    assert len(plain_finish) + len(plain_errors) == 9
    assert len(threaded["plain", 0]) == 40 and len(threaded["short", 0]) == 3
    for key, rows in plain.items():
        assert [t for t, _, _ in threaded[key]] == [t for t, _, _ in rows], key
    for (_, lp, top), (_, lp0, top0) in zip(threaded["lp", 0], plain["lp", 0], strict=True):
        assert lp == pytest.approx(lp0, abs=1e-5)
        assert [i for i, _ in top] == [i for i, _ in top0]


def test_a_closed_encoder_hands_its_thread_and_stream_back() -> None:
    first = Encoder()
    with mx.stream(first.stream):  # what the encoder queues lives on its stream
        x = mx.arange(8) * 2
    first.submit(x)
    first.settle()
    assert x.tolist() == [0, 2, 4, 6, 8, 10, 12, 14]
    first.close()
    assert not first._thread.is_alive()
    # The next encoder takes the same stream: router mode's reloads make no new streams.
    second = Encoder()
    try:
        assert second.stream == first.stream
        assert first.stream not in encoding._STREAMS
    finally:
        second.close()
    assert second.stream in encoding._STREAMS


def test_what_queuing_raised_comes_back_at_the_next_settle() -> None:
    enc = Encoder()
    try:
        # Lazy on this thread's own stream, which no other thread may queue onto.
        enc.submit(mx.ones(3) + 1)
        with pytest.raises(RuntimeError, match="Stream"):
            enc.settle()
        enc.settle()  # raised once, then the encoder is idle and usable again
        with mx.stream(enc.stream):
            y = mx.ones(3) + 0
        enc.submit(y)
        enc.settle()
        assert y.tolist() == [1.0, 1.0, 1.0]
    finally:
        enc.close()
