"""The embedder actor on a fake backend: order, micro-batches, queue bound, timeout, cancel."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import trio
import trio.testing

from mlxcel.actors.embedder import Embedder
from mlxcel.models.embedder_info import EmbedderInfo, Encoded
from mlxcel.runtime.errors import ServerBusy, Timeout
from mlxcel.runtime.messages import EmbedInput


class FakeBackend:
    """Vector of an input = [its length, its first id]; optionally blocks in forward."""

    def __init__(self) -> None:
        self.info = EmbedderInfo(
            model_id="fake",
            path=Path("/fake"),
            kind="encoder",
            dim=2,
            vocab_size=1000,
            max_length=64,
            pooling="mean",
        )
        self.batches: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def encode_texts(self, inputs: Sequence[EmbedInput]) -> list[Encoded]:
        return [
            Encoded(tuple(range(1, len(i) + 1)) if isinstance(i, str) else tuple(i)) for i in inputs
        ]

    def encode_pairs(self, query: str, documents: Sequence[str]) -> list[Encoded]:
        return [
            Encoded(tuple(range(len(query) + len(d))), tuple([0] * len(query) + [1] * len(d)))
            for d in documents
        ]

    def forward(self, batch: Sequence[Encoded]) -> np.ndarray:
        self.entered.set()
        self.gate.wait(10)
        self.batches.append([len(e.ids) for e in batch])
        if batch[0].types is not None:
            return np.array([len(e.ids) / 100 for e in batch], dtype=np.float32)
        return np.array([[len(e.ids), e.ids[0]] for e in batch], dtype=np.float32)


async def _started(nursery: trio.Nursery, backend: FakeBackend, **kw: object) -> Embedder:
    embedder = Embedder(lambda: backend, **kw)  # type: ignore[arg-type]
    await nursery.start(embedder.run)
    return embedder


async def test_results_come_back_in_request_order_from_length_sorted_batches() -> None:
    backend = FakeBackend()
    async with trio.open_nursery() as nursery:
        embedder = await _started(nursery, backend, batch_size=3)
        texts = ["x" * n for n in (5, 1, 9, 3, 7, 2, 8)]
        result = await embedder.embed(texts)
        nursery.cancel_scope.cancel()
    assert [int(r[0]) for r in np.asarray(result.values)] == [5, 1, 9, 3, 7, 2, 8]
    assert result.token_counts == (5, 1, 9, 3, 7, 2, 8)
    assert backend.batches == [[1, 2, 3], [5, 7, 8], [9]]


async def test_waiting_jobs_share_micro_batches_and_pairs_score() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    async with trio.open_nursery() as nursery:
        embedder = await _started(nursery, backend, batch_size=16)
        results: dict[str, object] = {}

        async def one(name: str, inputs: list[EmbedInput]) -> None:
            results[name] = await embedder.embed(inputs)

        async with trio.open_nursery() as jobs:  # closes when all three have their results
            jobs.start_soon(one, "first", ["a"])
            await trio.to_thread.run_sync(backend.entered.wait)
            jobs.start_soon(one, "second", ["aaaa", [7, 8]])
            jobs.start_soon(one, "third", ["aaa", "aaaaa"])
            await trio.testing.wait_all_tasks_blocked()  # both are queued
            backend.gate.set()
        nursery.cancel_scope.cancel()
    assert backend.batches == [[1], [2, 3, 4, 5]]
    np.testing.assert_allclose(np.asarray(results["second"].values), [[4, 1], [2, 7]])  # type: ignore[attr-defined]
    np.testing.assert_allclose(np.asarray(results["third"].values)[:, 0], [3, 5])  # type: ignore[attr-defined]


async def test_a_cross_encoder_job_gets_one_score_per_document() -> None:
    backend = FakeBackend()
    async with trio.open_nursery() as nursery:
        embedder = await _started(nursery, backend)
        result = await embedder.score("qq", ["a", "bbb"])
        nursery.cancel_scope.cancel()
    np.testing.assert_allclose(np.asarray(result.values), [0.03, 0.05])
    assert result.token_counts == (3, 5)


async def test_a_full_queue_is_server_busy_and_a_slow_answer_times_out() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    async with trio.open_nursery() as nursery:
        embedder = await _started(nursery, backend, queue_depth=1, timeout=0.3)

        async def running() -> None:
            with pytest.raises(Timeout):
                await embedder.embed(["running"])

        nursery.start_soon(running)
        await trio.to_thread.run_sync(backend.entered.wait)
        timed_out = trio.Event()

        async def queued() -> None:
            with pytest.raises(Timeout):
                await embedder.embed(["queued"])
            timed_out.set()

        nursery.start_soon(queued)
        await trio.testing.wait_all_tasks_blocked()  # "queued" holds the one place
        with pytest.raises(ServerBusy):
            await embedder.embed(["refused"])
        await timed_out.wait()
        backend.gate.set()
        nursery.cancel_scope.cancel()


async def test_a_cancelled_request_is_dropped_before_it_runs() -> None:
    backend = FakeBackend()
    backend.gate.clear()
    async with trio.open_nursery() as nursery:
        embedder = await _started(nursery, backend, batch_size=1)
        nursery.start_soon(embedder.embed, ["a"])
        await trio.to_thread.run_sync(backend.entered.wait)
        with trio.move_on_after(0.05):
            await embedder.embed(["abandoned" * 3])
        result = await _release_and_embed(backend, embedder)
        nursery.cancel_scope.cancel()
    assert [b for b in backend.batches if b == [27]] == []
    assert int(np.asarray(result.values)[0][0]) == 2


async def _release_and_embed(backend: FakeBackend, embedder: Embedder):  # type: ignore[no-untyped-def]
    backend.gate.set()
    return await embedder.embed(["bb"])
