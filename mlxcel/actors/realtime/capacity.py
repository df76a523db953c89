"""How many realtime voice sessions a server admits at once (issue 39): as many as its decode
slots and speech workers can serve at real-time pace, unless the operator says otherwise.

A voice user does not repeat a sentence, so a session once admitted must be served; the only
place to say no is at the WebSocket's open (``server_busy``, close 1013). That cap is derived
from the two things every turn of every session needs at once, in the worst case that all the
admitted users finish speaking at the same moment:

* **a decode row** (``--parallel``). A session answers one turn at a time, and its answer
  holds a row while it is generated. Realtime answers go ahead of queued HTTP requests, but a
  turn that ends while every row is taken waits for another session's *whole* answer (seconds
  of decoding) before its first token: no longer real-time pace.
* **a place at each speech worker** (``--audio-queue-depth``, per worker). In its steady state a
  session holds one job at the speech-to-text worker (its turn's transcription; the early one
  started at a VAD pause becomes the turn's, or is cancelled and dropped) and one at the
  text-to-speech worker (the sentence it speaks next). A job that has its place is served in
  deadline order, so a live turn goes ahead of work due later; a session past the depth has
  its turn wait in line for a place instead (kept, never dropped, but it waits for other jobs
  to *finish*, not just for the steps due before it).

So ``capacity = min(parallel, audio_queue_depth)``. What the speech models cost per second of
audio is not known at start (they load on first use, and their speed is the machine's): on the
2-core reference machine one Piper thread speaks for ~8 listeners at once (~0.2 CPU-s per
second of speech, listeners hearing ~60 % of the time; docs/performance.md), which is what the
default depth of 8 allows. On a slower machine, lower the depth (and so the cap), or the cap.

``--realtime-max-sessions`` above the derived figure is allowed (an operator who knows the
traffic may overcommit) but warned about at start, naming both numbers and what to change.
"""

from __future__ import annotations

import logging

import attrs


@attrs.frozen
class SessionCapacity:
    """The realtime session cap, and the figures it comes from."""

    # Sessions admitted at once: --realtime-max-sessions, or ``derived`` when not given.
    limit: int
    # What the decode rows and the speech workers' places serve at real-time pace.
    derived: int
    # The two figures ``derived`` is the smaller of.
    parallel: int
    audio_queue_depth: int
    # True when --realtime-max-sessions was given (``limit`` is the operator's).
    explicit: bool

    def warning(self) -> str | None:
        """What to tell the operator at start when the cap is above what the server carries;
        None when it is not."""
        if self.limit <= self.derived:
            return None
        # The figures below the cap: each must rise to it for the cap to be served.
        short = [
            (flag, value, what)
            for flag, value, what in (
                ("--parallel", self.parallel, "decode rows"),
                ("--audio-queue-depth", self.audio_queue_depth, "places per speech worker"),
            )
            if value < self.limit
        ]
        return (
            f"--realtime-max-sessions {self.limit} is above the {self.derived} realtime sessions "
            f"this server can serve at real-time pace "
            f"({' and '.join(f'{flag} {value}: {what}' for flag, value, what in short)}): past "
            f"{self.derived} sessions, turns wait for a free row or worker place and answers "
            f"come late. Raise {' and '.join(flag for flag, _, _ in short)} to {self.limit}, "
            f"or lower --realtime-max-sessions to {self.derived} (or leave it out: the cap is "
            "then derived)."
        )


def derived_capacity(parallel: int, audio_queue_depth: int) -> int:
    """Realtime sessions served at real-time pace: one decode row and one place at each speech
    worker per session (see the module docstring for why)."""
    return max(1, min(parallel, audio_queue_depth))


def session_capacity(
    max_sessions: int | None, *, parallel: int, audio_queue_depth: int
) -> SessionCapacity:
    """The cap for ``--realtime-max-sessions`` (None: not given) on a server decoding
    ``parallel`` rows (the model's own, when it batches fewer than --parallel) with speech
    workers of ``audio_queue_depth`` places."""
    derived = derived_capacity(parallel, audio_queue_depth)
    return SessionCapacity(
        limit=derived if max_sessions is None else max_sessions,
        derived=derived,
        parallel=parallel,
        audio_queue_depth=audio_queue_depth,
        explicit=max_sessions is not None,
    )


def announce(capacity: SessionCapacity, log: logging.Logger) -> None:
    """Log the cap at start, and the warning when it is above what the server carries."""
    source = (
        "--realtime-max-sessions"
        if capacity.explicit
        else f"min(--parallel {capacity.parallel}, --audio-queue-depth "
        f"{capacity.audio_queue_depth})"
    )
    log.info("realtime voice sessions at once: %d (%s)", capacity.limit, source)
    if (warning := capacity.warning()) is not None:
        log.warning("%s", warning)
