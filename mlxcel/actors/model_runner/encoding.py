"""A decode step's graph handed to mlx from a thread of its own, so the model runner's thread
is free while the step computes.

Why: ``mx.async_eval`` does not return once the graph is queued. mlx encodes a graph node by
node on the calling thread and lets it run at most ~10 tasks (~50 nodes) ahead of the stream
that computes them (``MAX_ACTIVE_TASKS`` in mlx's ``transforms.cpp``), so a step of ~850
nodes keeps the caller inside ``async_eval`` until the step is all but done. Everything the
runner then does before the next step's graph is queued (hand the tokens to the scheduler
and take its next plan, build the next graph in Python: ~6 ms of a ~21 ms step of the default
model at one row) left the stream idle. Here the runner builds step n+1's graph while this
thread is still encoding step n.

The rule that keeps this safe: mlx's command encoder for a stream is not thread-safe, so only
one thread may encode onto the stream at a time. The runner may build graphs (create lazy
arrays) at any time, but must ``settle()`` (wait until this thread has queued everything it
was given) before anything that evaluates an array that is not yet queued: ``mx.eval`` of new
work, ``.item()``, ``.tolist()``, a host sync of any kind. ``submit`` settles first, so a
step's own reads of the previous step's tokens (queued by then) only wait for their results.
The stream is one that any thread may encode onto (``mx.new_thread_unsafe_stream``), held by
one backend at a time (``_STREAMS``): two backends (router mode) each get their own.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import mlx.core as mx

__all__ = ["Encoder"]

# Streams of finished backends, for the next one: mlx never destroys a stream (nor its worker
# thread), so router mode's loads and unloads reuse them; at most as many as backends were
# ever alive at once.
_STREAMS: list[mx.Stream] = []
_STREAMS_LOCK = threading.Lock()


def _take_stream() -> mx.Stream:
    with _STREAMS_LOCK:
        if _STREAMS:
            return _STREAMS.pop()
    return mx.new_thread_unsafe_stream(mx.cpu)


def _give_stream(stream: mx.Stream) -> None:
    with _STREAMS_LOCK:
        _STREAMS.append(stream)


class _State:
    """What the encoder's thread shares with its owner (never the owner itself, so that a
    backend dropped without ``close`` is collected and its thread stops)."""

    def __init__(self, stream: mx.Stream) -> None:
        self.stream = stream
        self.cond = threading.Condition()
        self.job: tuple[Any, ...] | None = None
        self.busy = False
        self.error: BaseException | None = None
        self.closed = False


def _stop(state: _State) -> None:
    with state.cond:
        state.closed = True
        state.cond.notify_all()


def _serve(state: _State) -> None:
    """The encoder's thread: queue each job; on close, hand the stream back (here, after the
    last job, so that no two threads ever encode onto it)."""
    # mlx's eval asks for the calling thread's default stream: this thread's is the encoder's,
    # so mlx makes it none of its own (a thread's own stream must not outlive it).
    mx.set_default_stream(state.stream)
    while True:
        with state.cond:
            while state.job is None and not state.closed:
                state.cond.wait()
            if state.job is None:
                break
            job, state.job = state.job, None
        try:
            mx.async_eval(*job)  # releases the GIL while it encodes
        except BaseException as e:  # handed to the runner at its next settle
            state.error = e
        del job
        with state.cond:
            state.busy = False
            state.cond.notify_all()
    mx.synchronize(state.stream)  # its work done before anyone else may queue on it
    _give_stream(state.stream)


class Encoder:
    """One thread that queues step graphs on ``stream`` (``mx.async_eval``), one at a time."""

    def __init__(self) -> None:
        self._state = state = _State(_take_stream())
        self.stream = state.stream
        self._thread = threading.Thread(
            target=_serve, args=(state,), name="mlxcel-encoder", daemon=True
        )
        self._thread.start()
        # Dropped without close (a test's backend): the thread still ends.
        self._finalizer = weakref.finalize(self, _stop, state)

    def submit(self, *arrays: Any) -> None:
        """Queue ``arrays`` (any tree ``mx.async_eval`` takes) for evaluation; returns at once,
        after the previous submission has been queued."""
        state = self._state
        with state.cond:
            self._wait_idle()
            state.job = arrays
            state.busy = True
            state.cond.notify_all()

    def settle(self) -> None:
        """Wait until everything submitted is queued on the stream (not computed); raises
        what queuing it raised. Cheap when nothing is pending."""
        state = self._state
        if not state.busy and state.error is None:
            return
        with state.cond:
            self._wait_idle()

    def close(self) -> None:
        """Stop the thread once its last job is queued, and wait until the stream's work is
        done (the thread then hands the stream back)."""
        self._finalizer()
        self._thread.join()

    def _wait_idle(self) -> None:
        state = self._state
        while state.busy:
            state.cond.wait()
        if state.error is not None:
            error, state.error = state.error, None
            raise error
