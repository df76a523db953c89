"""The model registry's router policy (actors/registry.py) with fake models: loads that take
time and admissions that requests hold, on Trio's autojump clock (no mlx, no HTTP).

The end-to-end behaviour on real models is in tests/e2e/test_router.py; here the orderings
that are hard to time there: first come first served, one load shared by its waiters, one
eviction for two waiters, a waiter that leaves, a failed load.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import trio
import trio.testing

from mlxcel.actors.admission import Admission
from mlxcel.actors.hosting import Hosted
from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.pipeline import LocalPipeline
from mlxcel.actors.registry import Registry
from mlxcel.runtime.errors import InternalError, InvalidRequest, NotFound
from mlxcel.runtime.messages import CacheStats, SchedulerStatistics
from mlxcel.runtime.slot import AbortBox

LOAD_SECONDS = 5.0


class Counting:
    """A fake scheduler whose statistics say its prompt cache had one hit per use."""

    def __init__(self) -> None:
        self.hits = 0

    def statistics(self) -> SchedulerStatistics:
        return SchedulerStatistics(cache=CacheStats(hits=self.hits, entries=1))


class Farm:
    """Fake models: each load takes LOAD_SECONDS; "bad" fails."""

    def __init__(self) -> None:
        self.loads: list[str] = []
        self.unloads: list[str] = []
        self.schedulers: dict[str, Counting] = {}

    async def host(self, name: str, source: str, *, task_status: Any) -> None:
        self.loads.append(name)
        await trio.sleep(LOAD_SECONDS)
        if name == "bad":
            raise RuntimeError("no such architecture")
        tx, _rx = trio.open_memory_channel[Any](10)
        admission = Admission(max_queue_depth=4, outbox=tx, aborts=AbortBox())
        info = ModelInfo(
            model_id=name,
            path=None,
            tokenizer=None,
            eos_token_ids=frozenset(),
            context_length=64,
            chat_template=None,
        )
        scheduler = Counting()
        self.schedulers[name] = scheduler
        pipeline = LocalPipeline(admission, None, scheduler, None)  # type: ignore[arg-type]  # admission and statistics only
        task_status.started(Hosted(name, info, pipeline, None, 1))
        try:
            await trio.sleep_forever()
        finally:
            self.unloads.append(name)


@asynccontextmanager
async def running(farm: Farm, **kw: Any) -> AsyncIterator[Registry]:
    """A router-mode registry over the farm's models a, b, c and bad, running."""
    reg = Registry({n: n for n in ("a", "b", "c", "bad")}, farm.host, router=True, **kw)
    async with trio.open_nursery() as nursery:
        await nursery.start(reg.run)
        yield reg
        nursery.cancel_scope.cancel()


async def status(reg: Registry, name: str) -> str:
    await trio.testing.wait_all_tasks_blocked()
    return next(line.status for line in reg.listing() if line.name == name)


async def use(reg: Registry, name: str, seconds: float = 0.0) -> None:
    """A request: the model leased for ``seconds``."""
    with reg.request_scope():
        await reg.get(name)
        await trio.sleep(seconds)


async def test_cache_counters_do_not_go_down_when_a_model_unloads(autojump_clock: Any) -> None:
    farm = Farm()
    async with running(farm, max_loaded=1) as reg:
        await use(reg, "a")
        farm.schedulers["a"].hits = 3
        assert reg.statistics().cache.hits == 3
        await use(reg, "b")  # a unloads to make room
        await trio.testing.wait_all_tasks_blocked()
        assert farm.unloads == ["a"]
        farm.schedulers["b"].hits = 2
        cache = reg.statistics().cache
        # The counter keeps a's hits; a gauge (entries) counts only what is loaded.
        assert (cache.hits, cache.entries) == (5, 1)


async def test_requests_for_one_model_share_its_load(autojump_clock: Any) -> None:
    farm = Farm()
    async with running(farm, max_loaded=2) as reg:
        async with trio.open_nursery() as requests:
            for _ in range(3):
                requests.start_soon(use, reg, "a")
        assert farm.loads == ["a"]
        assert await status(reg, "a") == "loaded"


async def test_the_least_recently_used_idle_model_makes_room(autojump_clock: Any) -> None:
    farm = Farm()
    async with running(farm, max_loaded=2) as reg:
        await use(reg, "a")
        await use(reg, "b")
        await use(reg, "a")
        await use(reg, "c")
        assert farm.unloads == ["b"]
        assert [await status(reg, n) for n in "abc"] == ["loaded", "unloaded", "loaded"]


async def test_a_busy_model_stays_and_waiters_are_served_in_order(autojump_clock: Any) -> None:
    farm = Farm()
    done: list[str] = []

    async def request(name: str, seconds: float) -> None:
        await use(reg, name, seconds)
        done.append(name)

    async with running(farm, max_loaded=1) as reg:
        await use(reg, "a")
        async with trio.open_nursery() as requests:
            requests.start_soon(request, "a", 20.0)  # holds a for 20 s
            await trio.sleep(1)
            requests.start_soon(request, "b", 0.0)
            await trio.sleep(1)
            requests.start_soon(request, "c", 0.0)
            await trio.sleep(10)
            # a is busy: nothing was unloaded, b and c wait.
            assert farm.unloads == [] and await status(reg, "a") == "loaded"
        assert done == ["a", "b", "c"], (farm.loads, farm.unloads)
        assert farm.unloads == ["a", "b"]


async def test_two_waiters_for_one_place_share_one_eviction(autojump_clock: Any) -> None:
    farm = Farm()
    async with running(farm, max_loaded=1) as reg:
        await use(reg, "a")
        async with trio.open_nursery() as requests:
            requests.start_soon(use, reg, "b")
            requests.start_soon(use, reg, "c")
        # They arrived together (in either order): both served, a given up once.
        assert farm.loads[0] == "a" and sorted(farm.loads[1:]) == ["b", "c"]
        assert farm.unloads == ["a", farm.loads[1]]


async def test_a_waiter_that_leaves_costs_no_model_its_place(autojump_clock: Any) -> None:
    farm = Farm()
    async with running(farm, max_loaded=1) as reg:
        await use(reg, "a")
        async with trio.open_nursery() as requests:
            requests.start_soon(use, reg, "a", 30.0)
            await trio.sleep(1)
            with trio.move_on_after(2):  # the client gives up while a is busy
                await use(reg, "b")
        await trio.sleep(10)
        assert farm.loads == ["a"] and farm.unloads == []
        assert await status(reg, "b") == "unloaded"


async def test_a_failed_load_is_reported_and_tried_again_later(autojump_clock: Any) -> None:
    farm = Farm()
    async with running(farm, max_loaded=2) as reg:
        with pytest.raises(InternalError, match="no such architecture"):
            await use(reg, "bad")
        assert await status(reg, "bad") == "failed"
        await use(reg, "a")  # the others serve on
        with pytest.raises(InternalError):
            await use(reg, "bad")
        assert farm.loads == ["bad", "a", "bad"]


async def test_names_and_autoload(autojump_clock: Any) -> None:
    farm = Farm()
    async with running(farm, max_loaded=2, autoload=False) as reg:
        with pytest.raises(NotFound, match="a, b, bad, c"):
            await reg.get("gpt-4o")
        with pytest.raises(InvalidRequest, match="/models/load"):
            await reg.get("a")
        await reg.load("a")
        assert await status(reg, "a") == "loading"
        await trio.sleep(LOAD_SECONDS + 1)
        assert await status(reg, "a") == "loaded"
        await reg.unload("a")
        assert await status(reg, "a") == "unloaded" and farm.unloads == ["a"]
