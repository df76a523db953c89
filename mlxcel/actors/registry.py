"""The model registry: the models this server serves, which of them are loaded, and (in
router mode) loading and unloading them by name.

One model (``-m``): one entry, loaded at start and never unloaded; any ``model`` name is
served (or a 404 with ``--strict-model-names``). Router mode (``--models-dir``): one entry per
model found, each loaded as its own pipeline (``actors.hosting``) in the registry's nursery:

- a request naming an unloaded model loads it (``--models-autoload``; off: a 400 saying how
  to load it) and waits, bounded by ``--timeout``, cancellable like any wait;
- at most ``--models-max`` are loaded or loading; a load that needs room unloads the least
  recently used *idle* model (no request holds it, nothing admitted), else it waits, first
  come first served, until one is idle;
- requests for one model share its load; a load whose requests have all gone is dropped
  before it starts (so a client that gave up costs no model its place);
- a failed load is reported to the requests waiting for it, and the others keep serving.

"Holds it": each HTTP request (and each realtime session) leases the models it asked for
until its response is fully sent (``request_scope``, entered by the ASGI middleware), so a
model is never unloaded under a stream that is still being written.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import attrs
import trio

from mlxcel.actors.hosting import Hosted
from mlxcel.runtime.errors import InternalError, InvalidRequest, NotFound, Timeout
from mlxcel.runtime.messages import CacheStats, SchedulerStatistics

log = logging.getLogger(__name__)

# What starts one model's pipeline: ``host(name, source, task_status=...)`` runs until
# cancelled (``actors.hosting.host_model`` with the server's settings bound).
HostModel = Callable[..., Awaitable[None]]

UNLOADED, LOADING, LOADED = "unloaded", "loading", "loaded"
UNLOADING, FAILED = "unloading", "failed"


@attrs.define(eq=False)
class Entry:
    name: str
    # What -m would take: a folder, a .gguf file, a hub repo id.
    source: str
    status: str = UNLOADED
    hosted: Hosted | None = None
    scope: trio.CancelScope | None = None
    # Requests and sessions holding it now, and when the last one asked for it.
    leases: int = 0
    last_used: float = 0.0
    # Requests waiting for its load (a queued load nobody waits for any more is dropped).
    waiters: int = 0
    # Asked for by /models/load (kept queued even with nobody waiting).
    pinned_load: bool = False
    error: str | None = None
    # Loads completed since start (router mode swaps models: /metrics shows how often).
    loads: int = 0

    @property
    def busy(self) -> bool:
        """Requests hold it, wait for it (a model just loaded is theirs first), or run on it."""
        return (
            self.leases > 0
            or self.waiters > 0
            or (self.hosted is not None and self.hosted.admission.active > 0)
        )


@attrs.frozen
class ModelStatus:
    """One line of the model list (``GET /models``, ``/v1/models``)."""

    name: str
    source: str
    status: str
    hosted: Hosted | None
    error: str | None


_leases: contextvars.ContextVar[list[Entry] | None] = contextvars.ContextVar(
    "mlxcel_model_leases", default=None
)


class Registry:
    def __init__(
        self,
        entries: dict[str, str],
        host: HostModel,
        *,
        router: bool,
        max_loaded: int = 4,
        autoload: bool = True,
        strict_names: bool = False,
        load_timeout: float = 600.0,
        drain_timeout: float = 10.0,
    ) -> None:
        """``entries``: model name -> source. Not ``router``: exactly one entry, loaded by
        ``run`` before it reports started."""
        if not router:
            assert len(entries) == 1
        self._entries = {n: Entry(n, s) for n, s in entries.items()}
        self._host = host
        self.router = router
        # 0: no limit (llama-server's meaning).
        self.max_loaded = max_loaded
        self.autoload = autoload
        self._strict = strict_names
        self._load_timeout = load_timeout
        self._drain_timeout = drain_timeout
        # Loads waiting for room, in arrival order.
        self._queue: list[Entry] = []
        self._changed = trio.Event()
        self._nursery: trio.Nursery | None = None
        self._draining = False
        # The prompt and vision cache counters of models unloaded so far: /metrics adds them,
        # so a counter never goes down when a model leaves.
        self._retired = CacheStats()

    # --- running ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Host the models until cancelled. Not in router mode, the one model is loaded
        before ``started`` (a failure to load is raised from here, ending the server)."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if not self.router:
                (entry,) = self._entries.values()
                entry.status = LOADING
                entry.hosted = await nursery.start(self._host_forever, entry)
                entry.status = LOADED
            task_status.started()
            await trio.sleep_forever()

    async def _host_forever(self, entry: Entry, *, task_status: trio.TaskStatus[Hosted]) -> None:
        await self._host(entry.name, entry.source, task_status=task_status)

    def _notify(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    # --- the HTTP side ------------------------------------------------------------------

    @property
    def names(self) -> list[str]:
        return sorted(self._entries)

    def listing(self) -> list[ModelStatus]:
        return [
            ModelStatus(e.name, e.source, e.status, e.hosted, e.error)
            for e in sorted(self._entries.values(), key=lambda e: e.name)
        ]

    def loads(self) -> dict[str, int]:
        """Model name -> loads completed since start (router mode; for /metrics)."""
        return {e.name: e.loads for e in self._entries.values()} if self.router else {}

    def loaded(self) -> list[Hosted]:
        return [e.hosted for e in self._entries.values() if e.hosted is not None]

    def default(self) -> Hosted | None:
        """The one model (not router mode), else the only loaded one, else None."""
        hosted = self.loaded()
        return hosted[0] if len(hosted) == 1 else None

    def lookup(self, requested: str | None) -> Entry:
        """The entry a request's ``model`` names (NotFound listing the names)."""
        if not self.router:
            (entry,) = self._entries.values()
            if requested is None or not self._strict or requested in self._accepted(entry):
                return entry
            raise NotFound(
                f"The model '{requested}' does not exist. This server serves '{entry.name}' "
                f"(also reachable as 'default').",
                param="model",
            )
        if requested is None:
            raise InvalidRequest(
                "This server serves several models: name one in 'model' "
                f"(one of: {', '.join(self.names)}).",
                param="model",
            )
        if (found := self._entries.get(requested)) is None:
            raise NotFound(
                f"The model '{requested}' does not exist. Models: {', '.join(self.names)}.",
                param="model",
            )
        return found

    def aliases(self, name: str) -> frozenset[str]:
        """The names a request may call the model ``name`` by (the one model: also its
        folder's and "default", with --strict-model-names too)."""
        if not self.router:
            (entry,) = self._entries.values()
            return frozenset(self._accepted(entry))
        return frozenset({name})

    def _accepted(self, entry: Entry) -> set[str]:
        if self.router:
            return {entry.name}
        names = {entry.name, "default"}
        if (hosted := entry.hosted) is not None:
            names.add(hosted.name)
            if hosted.info.path is not None:
                names.add(hosted.info.path.name)
        return names

    async def get(self, requested: str | None) -> Hosted:
        """The loaded model a request names, leased to the request in progress.

        Router mode: an unloaded model is loaded first (or a 400 without autoload); the wait
        is bounded by the load timeout (504) and ends at once when the load fails (500 with
        the cause). Cancellation (the client left) ends the wait; a queued load that nobody
        waits for any more is dropped.
        """
        entry = self.lookup(requested)
        if entry.status == LOADED and entry.hosted is not None:
            return self._lease(entry)
        if entry.status in (UNLOADED, FAILED) and not self.autoload:
            raise InvalidRequest(
                f"The model '{entry.name}' is not loaded, and this server loads models only "
                f'when told to: POST /models/load {{"model": "{entry.name}"}} first '
                "(or start it with --models-autoload).",
                param="model",
            )
        entry.waiters += 1
        try:
            with trio.move_on_after(self._load_timeout) as waited:
                tried = False
                while True:
                    if entry.status == LOADED and entry.hosted is not None:
                        return self._lease(entry)
                    if entry.status == FAILED and tried:
                        # The load this request waited for failed; a later request tries
                        # again.
                        raise InternalError(
                            f"The model '{entry.name}' failed to load: {entry.error}"
                        )
                    if entry.status in (UNLOADED, FAILED):
                        self._enqueue(entry)
                    tried = tried or entry.status == LOADING
                    # A model also goes idle without a lease ending (a background generation
                    # finishing): look for room again now and then.
                    with trio.move_on_after(0.5):
                        await self._changed.wait()
                    if entry in self._queue:
                        self._pump()
            assert waited.cancelled_caught
            raise Timeout(f"The model '{entry.name}' did not load within {self._load_timeout:g} s")
        finally:
            entry.waiters -= 1
            if entry.waiters == 0 and entry in self._queue and not entry.pinned_load:
                self._queue.remove(entry)
                entry.status = UNLOADED
                self._notify()

    def _lease(self, entry: Entry) -> Hosted:
        assert entry.hosted is not None
        entry.last_used = time.monotonic()
        if (held := _leases.get()) is not None:
            entry.leases += 1
            held.append(entry)
        return entry.hosted

    @contextlib.contextmanager
    def request_scope(self) -> Iterator[None]:
        """Around one HTTP request or WebSocket session: the models it gets are leased
        until it ends (its response fully sent)."""
        held: list[Entry] = []
        token = _leases.set(held)
        try:
            yield
        finally:
            _leases.reset(token)
            for entry in held:
                entry.leases -= 1
                entry.last_used = time.monotonic()
            if held:
                self._notify()
                self._pump()  # a model that went idle may make room for a queued one

    # --- loading and unloading ----------------------------------------------------------

    async def load(self, name: str) -> None:
        """Start loading ``name`` (``POST /models/load``); returns at once."""
        entry = self.lookup(name)
        self._need_router("load")
        if entry.status in (LOADED, LOADING):
            return
        entry.pinned_load = True
        self._enqueue(entry)
        await trio.lowlevel.checkpoint()

    async def unload(self, name: str) -> None:
        """Unload ``name`` (``POST /models/unload``): new requests for it wait for it to be
        loaded again; the ones it runs finish first (``--graceful-timeout``, then ended as
        if they had reached their limit). Returns once it is unloaded."""
        entry = self.lookup(name)
        self._need_router("unload")
        if entry in self._queue:
            self._queue.remove(entry)
            entry.status, entry.pinned_load = UNLOADED, False
            self._notify()
            return
        # In the registry's nursery: a client that leaves does not leave it half done.
        self._begin_unload(entry)
        while entry.scope is not None:
            await self._changed.wait()

    def _need_router(self, what: str) -> None:
        if not self.router:
            raise InvalidRequest(
                f"This server serves one model (-m); models can {what} only in router mode "
                "(--models-dir)."
            )

    def _enqueue(self, entry: Entry) -> None:
        if entry in self._queue or entry.scope is not None:
            return
        entry.status, entry.error = LOADING, None
        self._queue.append(entry)
        self._pump()

    def _pump(self) -> None:
        """Start the queued loads that have room, oldest first; make room by unloading idle
        models, least recently used first."""
        assert self._nursery is not None
        while self._queue and not self._draining:
            active = [e for e in self._entries.values() if e.scope is not None]
            limit = self.max_loaded or len(self._entries)
            if len(active) >= limit:
                # Room already on its way (a model unloading) is not made twice.
                if sum(e.status == UNLOADING for e in active) > len(active) - limit:
                    return
                idle = [e for e in active if e.status == LOADED and not e.busy]
                if not idle:
                    return  # a lease ending or a load finishing pumps again
                victim = min(idle, key=lambda e: e.last_used)
                log.info("unloading %s (least recently used) to make room", victim.name)
                self._begin_unload(victim)
                return
            entry = self._queue.pop(0)
            entry.pinned_load = False
            entry.scope = trio.CancelScope()
            self._nursery.start_soon(self._load, entry)

    async def _load(self, entry: Entry) -> None:
        assert entry.scope is not None
        started = time.perf_counter()
        log.info("loading %s from %s", entry.name, entry.source)
        try:
            with entry.scope:
                async with trio.open_nursery() as nursery:
                    entry.hosted = await nursery.start(self._host_forever, entry)
                    entry.status = LOADED
                    entry.last_used = time.monotonic()
                    entry.loads += 1
                    log.info("loaded %s in %.1f s", entry.name, time.perf_counter() - started)
                    self._notify()
                    self._pump()
        except Exception as exc:  # a failed load is reported, the other models serve on
            entry.error = _cause(exc)
            log.error("loading %s failed: %s", entry.name, entry.error, exc_info=exc)
            entry.status = FAILED
        else:
            if entry.status != FAILED:
                entry.status = UNLOADED
        finally:
            if entry.hosted is not None:
                self._retire(entry.hosted.pipeline.statistics().cache)
                # Its pipeline is gone (unloaded, or one of its actors failed): a request
                # still holding a slot there ends now, with an error, instead of waiting on.
                entry.hosted.admission.interrupt_all()
            entry.hosted, entry.scope = None, None
            self._notify()
            self._pump()

    def _begin_unload(self, entry: Entry) -> None:
        """Mark it unloading now (so room is not made twice) and unload it in the registry's
        nursery."""
        if entry.scope is None or entry.status == UNLOADING:
            return
        assert self._nursery is not None
        entry.status = UNLOADING
        self._notify()
        self._nursery.start_soon(self._unload, entry)

    async def _unload(self, entry: Entry) -> None:
        """Stop the model's pipeline once what it runs has finished."""
        hosted, scope = entry.hosted, entry.scope
        assert scope is not None
        if hosted is not None:
            hosted.admission.drain()
            with trio.move_on_after(self._drain_timeout):
                await hosted.admission.wait_idle()
            hosted.admission.interrupt_all()
            with trio.move_on_after(2.0):
                await hosted.admission.wait_idle()
        log.info("unloading %s", entry.name)
        scope.cancel()

    # --- the whole server ---------------------------------------------------------------

    def drain(self) -> None:
        """Shutting down: every model refuses new work; nothing more is loaded."""
        self._draining = True
        for hosted in self.loaded():
            hosted.admission.drain()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def active(self) -> int:
        return sum(h.admission.active for h in self.loaded())

    def interrupt_all(self) -> None:
        for hosted in self.loaded():
            hosted.admission.interrupt_all()

    async def wait_idle(self) -> None:
        for hosted in self.loaded():
            await hosted.admission.wait_idle()

    @property
    def queued(self) -> int:
        return sum(h.admission.queued for h in self.loaded())

    def _retire(self, cache: CacheStats) -> None:
        self._retired = attrs.evolve(
            self._retired,
            **{name: getattr(self._retired, name) + getattr(cache, name) for name in _COUNTERS},
        )

    def statistics(self) -> SchedulerStatistics:
        """Every loaded model's scheduler, added up (for /metrics), with the cache counters of
        models unloaded before."""
        stats = [h.pipeline.statistics() for h in self.loaded()]
        if len(stats) == 1 and self._retired == CacheStats():
            return stats[0]
        caches = [s.cache for s in stats]
        retired = self._retired
        return SchedulerStatistics(
            running=sum(s.running for s in stats),
            waiting=sum(s.waiting for s in stats),
            rows=sum(s.rows for s in stats),
            slots=tuple(slot for s in stats for slot in s.slots),
            cache=CacheStats(
                **{
                    f.name: (max if f.name.startswith("mlx_") else sum)(
                        getattr(c, f.name) for c in caches
                    )
                    + (getattr(retired, f.name) if f.name in _COUNTERS else 0)
                    if caches
                    else getattr(retired, f.name)
                    for f in attrs.fields(CacheStats)
                }
            ),
        )


# CacheStats fields that count since start (Prometheus counters): the rest are gauges.
_COUNTERS = ("hits", "misses", "evictions", "vision_hits", "vision_misses")


def _cause(exc: BaseException) -> str:
    """One line for a failed load (the first error inside an exception group)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def scan_models_dir(folder: Path) -> dict[str, str]:
    """``--models-dir``: each model folder (a ``config.json`` inside, or ``.gguf`` files) and
    each ``.gguf`` file in it is a model, named by its folder or file name."""
    found: dict[str, str] = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith("."):
            continue
        if path.is_dir() and ((path / "config.json").is_file() or any(path.glob("*.gguf"))):
            found[path.name] = str(path)
        elif path.is_file() and path.suffix == ".gguf":
            found[path.stem] = str(path)
    return found
