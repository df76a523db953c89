"""Per-request hand-offs that never block the producer.

``OutputSlot`` is where the streamer leaves a request's output and the HTTP handler picks it
up. Producers call sync methods that only append and wake the reader, so a slow client never
stalls generation: deltas simply merge until the reader comes back for them.

``AbortBox`` collects the ids of requests that must stop (client gone, stop string matched).
The scheduler drains it at every step boundary, so cancellation is a message keyed by request
id, never a global flag.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import attrs
import trio

from mlxcel.runtime.errors import MlxcelError
from mlxcel.runtime.messages import FinishReason


class AbortBox:
    def __init__(self) -> None:
        self._ids: set[str] = set()

    def notify(self, request_id: str) -> None:
        self._ids.add(request_id)

    def drain(self) -> set[str]:
        ids, self._ids = self._ids, set()
        return ids


class Reservation:
    """One place in the admission queue, released exactly once by whoever dequeues it."""

    def __init__(self, limiter: trio.CapacityLimiter | None, borrower: object) -> None:
        self._limiter = limiter
        self._borrower = borrower

    def release(self) -> None:
        if self._limiter is not None:
            limiter, self._limiter = self._limiter, None
            limiter.release_on_behalf_of(self._borrower)


@attrs.frozen
class TokenLogprob:
    """One output token's log-probability and its most likely alternatives."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...]


@attrs.frozen
class SlotUpdate:
    """Everything that arrived since the last read, merged."""

    text: str
    n_tokens: int
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...] = ()
    # Thinking text (split out of the output) and tool-call events, in order.
    reasoning: str = ""
    tool_events: tuple[object, ...] = ()


class OutputSlot:
    def __init__(
        self,
        request_id: str,
        reservation: Reservation,
        aborts: AbortBox,
        on_close: Callable[[], None] = lambda: None,
    ) -> None:
        self.request_id = request_id
        self.reservation = reservation
        self._aborts = aborts
        self._on_close = on_close
        self._wake = trio.Event()
        self._accepted = trio.Event()
        self._text: list[str] = []
        self._logprobs: list[TokenLogprob] = []
        self._reasoning: list[str] = []
        self._tool_events: list[object] = []
        self._pending_tokens = 0
        self._finish: FinishReason | None = None
        self._error: MlxcelError | None = None
        self._delivered_finish = False
        self.submitted_at = time.monotonic()
        # Set by the scheduler when the request gets a running place, and at its first token.
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        # Set when a stop string (not an end-of-sequence token) ended the output.
        self.stop_word: str | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.cancelled = False

    # --- producer side: sync, never blocks --------------------------------------------------

    def accept(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._accepted.set()

    def push(self, text: str, n_tokens: int, logprob: TokenLogprob | None = None) -> None:
        if self.first_token_at is None and n_tokens:
            self.first_token_at = time.monotonic()
        if text:
            self._text.append(text)
        if logprob is not None:
            self._logprobs.append(logprob)
        self._pending_tokens += n_tokens
        self.completion_tokens += n_tokens
        self._wake.set()

    def push_reasoning(self, text: str) -> None:
        if text:
            self._reasoning.append(text)
            self._wake.set()

    def push_tool_event(self, event: object) -> None:
        self._tool_events.append(event)
        self._wake.set()

    def finish(self, reason: FinishReason, stop_word: str | None = None) -> None:
        if self._finish is None:
            self._finish = reason
            self.stop_word = stop_word
            self.finished_at = time.monotonic()
        self._wake.set()

    def fail(self, error: MlxcelError) -> None:
        if self._error is None and self._finish is None:
            self._error = error
        self._accepted.set()
        self._wake.set()

    @property
    def done(self) -> bool:
        return self._finish is not None or self._error is not None or self.cancelled

    # --- consumer side ----------------------------------------------------------------------

    async def wait_accepted(self) -> int:
        """Wait until the prompt is tokenized; raise the request's error if it failed first.

        Cancellation: the caller is expected to call ``cancel()`` in its ``finally``.
        """
        await self._accepted.wait()
        if self._error is not None:
            raise self._error
        return self.prompt_tokens

    async def next(self, timeout: float = math.inf) -> SlotUpdate | None:  # noqa: ASYNC109 - a timeout that returns None (keepalive due) is the point, not a cancel
        """Everything produced since the last call, or None when ``timeout`` passes first.

        Raises the request's error. After the finishing update, further calls raise
        ``trio.EndOfChannel``.
        """
        if self._delivered_finish:
            raise trio.EndOfChannel
        with trio.move_on_after(timeout):
            await self._wake.wait()
        if not self._wake.is_set():
            return None
        self._wake = trio.Event()
        if self._error is not None:
            raise self._error
        update = SlotUpdate(
            "".join(self._text),
            self._pending_tokens,
            self._finish,
            tuple(self._logprobs),
            "".join(self._reasoning),
            tuple(self._tool_events),
        )
        self._text.clear()
        self._logprobs.clear()
        self._reasoning.clear()
        self._tool_events.clear()
        self._pending_tokens = 0
        if self._finish is not None:
            self._delivered_finish = True
        return update

    def cancel(self) -> None:
        """The reader is gone or done: stop the work if it is still going. Idempotent."""
        if not self.cancelled:
            self.cancelled = True
            if self._finish is None and self._error is None:
                self._aborts.notify(self.request_id)
            self.reservation.release()
            self._on_close()
