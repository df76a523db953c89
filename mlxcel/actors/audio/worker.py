"""The thread both audio workers run on: a lazily built model, jobs served by deadline.

A worker owns one thread (``trio.to_thread.run_sync(..., abandon_on_cancel=False)``) that builds
its model on the first job (so a server that never hears a sound never pays for loading it; the
realtime actor can ask for it early with ``preload``), then serves jobs one *step* at a time
(one Whisper segment, one sentence of speech), always the step whose *deadline* is earliest.
A job's deadline is when its next output is needed: its admission time for the first step, then
later by the length of the audio it has produced (speech is played, and a transcription read,
at that pace). So a long job never makes a short one wait for all of it, and the first sentence
of a live reply (deadline: now) goes ahead of sentences other voices need only seconds later.

The Trio side holds at most ``queue_depth`` jobs at once, in two ways. ``admit_nowait`` (the
HTTP routes) refuses a job past the depth with ``ServerBusy``, a 503 the client retries.
``admit`` (a live voice turn, whose user does not repeat a sentence) waits for a place instead,
first come first served, for at most its ``timeout``: a place that frees up goes to the oldest
waiter before any new job, so a turn keeps its place in the line, and the HTTP routes meet a
full queue (503) until the waiters are in. The waiters are bounded by the realtime session cap
(a session waits for at most two transcriptions, its turn's and an early one, and one sentence
of speech at a time). A caller that
stops waiting (client gone, timeout, barge-in) leaves the line or marks its admitted job
cancelled; the thread drops it before its next step.
"""

from __future__ import annotations

import collections
import itertools
import logging
import math
import time
from collections.abc import Callable
from typing import Generic, Protocol, TypeVar

import trio

from mlxcel.runtime.errors import InternalError, MlxcelError, ServerBusy, Timeout
from mlxcel.runtime.messages import AudioWorkerStatistics

log = logging.getLogger(__name__)

B = TypeVar("B")
# Job only takes a backend in: a job for any backend is a job for a particular one.
B_contra = TypeVar("B_contra", contravariant=True)


class Job(Protocol[B_contra]):
    """One request's work, advanced on the worker's thread one step at a time."""

    # Set from the Trio side; read by the thread before each step (a stale read costs a step).
    cancelled: bool
    # ``time.monotonic()`` by which the next step's output is wanted (the job moves it on).
    deadline: float

    def step(self, backend: B_contra) -> bool:
        """Run one step on the worker's thread; True when the job is finished."""
        ...

    def fail(self, error: MlxcelError) -> None:
        """Called on the worker's thread when the job cannot go on."""
        ...


class _Preload:
    """A no-op job: builds the model ahead of the first real request."""

    cancelled = False
    deadline = -math.inf

    def step(self, backend: object) -> bool:
        return True

    def fail(self, error: MlxcelError) -> None:
        pass


class AudioWorker(Generic[B]):
    def __init__(
        self,
        build: Callable[[], B],
        *,
        name: str,
        queue_depth: int,
        waited: Callable[[str, float], None] = lambda name, seconds: None,
    ) -> None:
        self._build = build
        self.name = name
        self.queue_depth = queue_depth
        # Unbounded on purpose: admission bounds it (a job is admitted only under the depth).
        self._tx, self._rx = trio.open_memory_channel[Job[B]](math.inf)
        self.held = 0
        # Callers of ``admit`` in arrival order; ``release`` hands a place to the first.
        self._line: collections.deque[trio.Event] = collections.deque()
        self._refused = 0
        # Told how long each ``admit`` waited for its place (/metrics).
        self._waited = waited
        self.loaded = trio.Event()
        self.load_error: MlxcelError | None = None
        self._preloading = False

    def admit_nowait(self, job: Job[B]) -> None:
        """Queue ``job`` (Trio thread); ServerBusy when ``queue_depth`` jobs are held already
        or callers of ``admit`` are waiting for a place.

        Every admitted job must be handed back with ``release`` once its caller stops waiting.
        """
        if self.held >= self.queue_depth or self._line:
            self._refused += 1
            raise ServerBusy()
        self.held += 1
        self._tx.send_nowait(job)

    async def admit(self, job: Job[B], *, timeout: float) -> None:  # noqa: ASYNC109 - the wait's bound is the worker's
        """Queue ``job``, waiting for a place behind the callers already waiting (at most
        ``timeout`` seconds, then Timeout, a 504). Hand it back with ``release``.

        Cancelled while waiting: the caller leaves the line and nothing is queued (a place
        granted at that moment goes on to the next in line).
        """
        await trio.lowlevel.checkpoint()
        start = trio.current_time()
        if self.held < self.queue_depth and not self._line:
            self.held += 1
        else:
            place = trio.Event()
            self._line.append(place)
            try:
                with trio.move_on_after(timeout):
                    await place.wait()
            except BaseException:  # cancelled from outside: the caller is gone
                if place.is_set():
                    self.release()  # granted as the caller left: it goes to the next
                else:
                    self._line.remove(place)
                raise
            if not place.is_set():
                self._line.remove(place)
                raise Timeout(
                    f"The {self.name} worker had no place within {timeout:g} s "
                    "(see --audio-request-timeout-secs)."
                )
        self._waited(self.name, trio.current_time() - start)
        self._tx.send_nowait(job)

    def release(self) -> None:
        """Hand an admitted job's place back: to the first caller waiting, if any."""
        if self._line:
            self._line.popleft().set()  # the place passes on: ``held`` stays
        else:
            self.held -= 1

    def statistics(self) -> AudioWorkerStatistics:
        return AudioWorkerStatistics(self.held, self.queue_depth, len(self._line), self._refused)

    def preload(self) -> None:
        """Start building the model now, without a request (no-op once started)."""
        if not self._preloading and not self.loaded.is_set():
            self._preloading = True
            self._tx.send_nowait(_Preload())

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Ready at once; the model is built on the first job. Runs until cancelled.

        Cancellation reaches the thread while it waits for work; a step in progress (one
        segment, one sentence) finishes first, since native inference cannot be interrupted.
        """
        task_status.started()
        await trio.to_thread.run_sync(self._thread_main, abandon_on_cancel=False)

    def _thread_main(self) -> None:
        backend: B | None = None
        # (job, arrival order): equal deadlines are served first come, first served.
        active: list[tuple[Job[B], int]] = []
        arrivals = itertools.count()
        while True:
            if not active:
                try:
                    active.append((trio.from_thread.run(self._rx.receive), next(arrivals)))
                except trio.EndOfChannel:
                    return
            active.extend((j, next(arrivals)) for j in trio.from_thread.run_sync(self._drain))
            if backend is None and self.load_error is None:
                backend = self._load()
            chosen = min(active, key=lambda entry: (entry[0].deadline, entry[1]))
            active.remove(chosen)
            job = chosen[0]
            if job.cancelled:
                continue
            if backend is None:
                assert self.load_error is not None
                job.fail(self.load_error)
                continue
            try:
                done = job.step(backend)
            except MlxcelError as error:
                job.fail(error)
                done = True
            except Exception as error:  # noqa: BLE001 - one bad job fails alone; the worker lives
                log.exception("%s job failed", self.name)
                job.fail(InternalError(f"{self.name} failed: {type(error).__name__}: {error}"))
                done = True
            if not done:
                active.append((job, chosen[1]))

    def _load(self) -> B | None:
        try:
            backend = self._build()
        except MlxcelError as error:
            self.load_error = error
        except Exception as error:  # noqa: BLE001 - reported to every request, logged once
            log.exception("loading the %s model failed", self.name)
            self.load_error = InternalError(f"Loading the {self.name} model failed: {error}")
        trio.from_thread.run_sync(self.loaded.set)
        return None if self.load_error is not None else backend

    @staticmethod
    def now() -> float:
        """The clock deadlines are on (Trio's clock is offset on purpose; this one is not)."""
        return time.monotonic()

    def _drain(self) -> list[Job[B]]:
        jobs = []
        while True:
            try:
                jobs.append(self._rx.receive_nowait())
            except trio.WouldBlock:
                return jobs
