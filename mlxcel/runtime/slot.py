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
        self._choices: set[tuple[str, int]] = set()

    def notify(self, request_id: str) -> None:
        self._ids.add(request_id)

    def notify_choice(self, request_id: str, choice: int) -> None:
        """Stop one choice of a multi-choice request; its siblings go on."""
        self._choices.add((request_id, choice))

    def drain(self) -> set[str]:
        ids, self._ids = self._ids, set()
        return ids

    def drain_choices(self) -> set[tuple[str, int]]:
        choices, self._choices = self._choices, set()
        return choices


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
    """Everything that arrived for one choice since the last read, merged."""

    text: str
    n_tokens: int
    finish_reason: FinishReason | None
    logprobs: tuple[TokenLogprob, ...] = ()
    # Thinking text (split out of the output) and tool-call events, in order.
    reasoning: str = ""
    tool_events: tuple[object, ...] = ()
    # The choice (OpenAI `index`) this update belongs to.
    index: int = 0
    # The ids of the tokens generated since the last read (llama-server streams them).
    token_ids: tuple[int, ...] = ()


@attrs.define
class _Choice:
    """One choice's output not yet read, and its totals."""

    text: list[str] = attrs.field(factory=list)
    logprobs: list[TokenLogprob] = attrs.field(factory=list)
    reasoning: list[str] = attrs.field(factory=list)
    tool_events: list[object] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    pending_tokens: int = 0
    tokens: int = 0
    finish: FinishReason | None = None
    stop_word: str | None = None
    delivered: bool = False

    @property
    def has_news(self) -> bool:
        pending = self.text or self.logprobs or self.reasoning or self.tool_events
        return bool(pending or self.pending_tokens) or (
            self.finish is not None and not self.delivered
        )

    def take(self, index: int) -> SlotUpdate:
        update = SlotUpdate(
            "".join(self.text),
            self.pending_tokens,
            self.finish,
            tuple(self.logprobs),
            "".join(self.reasoning),
            tuple(self.tool_events),
            index,
            tuple(self.token_ids),
        )
        self.token_ids.clear()
        self.text.clear()
        self.logprobs.clear()
        self.reasoning.clear()
        self.tool_events.clear()
        self.pending_tokens = 0
        self.delivered = self.finish is not None
        return update


class OutputSlot:
    """One request's output: ``n`` choices, each merged separately until the reader comes.

    The request is finished once every choice is; producers name the choice (0 by default).
    """

    def __init__(
        self,
        request_id: str,
        reservation: Reservation,
        aborts: AbortBox,
        on_close: Callable[[], None] = lambda: None,
        n: int = 1,
    ) -> None:
        self.request_id = request_id
        self.reservation = reservation
        self._aborts = aborts
        self._on_close = on_close
        self._wake = trio.Event()
        self._accepted = trio.Event()
        # Set once cached_tokens is known (the request joined the batch), or it never will be.
        self._placed = trio.Event()
        self._choices = [_Choice() for _ in range(n)]
        self._error: MlxcelError | None = None
        self._delivered_finish = False
        self.submitted_at = time.monotonic()
        # Set by the scheduler when the request gets a running place, and at its first token.
        self.started_at: float | None = None
        self.first_token_at: float | None = None
        self.finished_at: float | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.cancelled = False
        # Ended by the shutdown drain, not by the model or the request's own limits.
        self.interrupted = False
        # Context shift cut the prompt or dropped tokens to go on (llama-server's `truncated`).
        self.context_shifted = False
        # The slot (/slots position) it runs in; -1 until it starts.
        self.id_slot = -1
        # return_progress: prompt tokens read (cached ones included) and when, one entry per
        # prefill chunk, kept only for a reader that asked and until it takes them.
        self._progress: list[tuple[int, float]] | None = None
        self._progress_mark = -1
        # Speculation: tokens proposed for this request and those the model accepted.
        self.draft_n = 0
        self.draft_n_accepted = 0

    @property
    def n(self) -> int:
        return len(self._choices)

    @property
    def completion_tokens(self) -> int:
        """Output tokens over every choice (what usage reports)."""
        return sum(c.tokens for c in self._choices)

    def choice_tokens(self, choice: int) -> int:
        return self._choices[choice].tokens

    @property
    def stop_word(self) -> str | None:
        """The stop string (not an end-of-sequence token) that ended the first choice."""
        return self._choices[0].stop_word

    @property
    def _finished(self) -> bool:
        return all(c.finish is not None for c in self._choices)

    # --- producer side: sync, never blocks --------------------------------------------------

    def accept(self, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self._accepted.set()

    def drafted(self, proposed: int, accepted: int) -> None:
        self.draft_n += proposed
        self.draft_n_accepted += accepted

    def placed(self, cached_tokens: int) -> None:
        """The request joined the batch, with this many prompt tokens from the prompt cache."""
        self.cached_tokens = cached_tokens
        self._placed.set()
        # llama-server's first report: processing started, the cached part already read.
        self.prefilled(cached_tokens)

    def prefilled(self, processed: int) -> None:
        """The prompt has been read up to ``processed`` tokens (a prefill chunk ended)."""
        if self._progress is not None and processed > self._progress_mark:
            self._progress_mark = processed
            self._progress.append((processed, time.monotonic()))
            self._wake.set()

    def push(
        self,
        text: str,
        n_tokens: int,
        logprob: TokenLogprob | None = None,
        *,
        choice: int = 0,
        token: int | None = None,
    ) -> None:
        self._placed.set()  # a backend that reports no cache lookup: none was made
        if self.first_token_at is None and n_tokens:
            self.first_token_at = time.monotonic()
            # The prompt's last token is read with the first generated one.
            self.prefilled(self.prompt_tokens)
        c = self._choices[choice]
        if text:
            c.text.append(text)
        if logprob is not None:
            c.logprobs.append(logprob)
        if token is not None:
            c.token_ids.append(token)
        c.pending_tokens += n_tokens
        c.tokens += n_tokens
        self._wake.set()

    def push_reasoning(self, text: str, *, choice: int = 0) -> None:
        if text:
            self._choices[choice].reasoning.append(text)
            self._wake.set()

    def push_tool_event(self, event: object, *, choice: int = 0) -> None:
        self._choices[choice].tool_events.append(event)
        self._wake.set()

    def finish(
        self, reason: FinishReason, stop_word: str | None = None, *, choice: int = 0
    ) -> None:
        self._placed.set()
        c = self._choices[choice]
        if c.finish is None:
            c.finish = reason
            c.stop_word = stop_word
            if self._finished:
                self.finished_at = time.monotonic()
        self._wake.set()

    def fail(self, error: MlxcelError) -> None:
        if self._error is None and not self._finished:
            self._error = error
        self._accepted.set()
        self._placed.set()
        self._wake.set()

    def interrupt(self, error: MlxcelError) -> None:
        """The server is shutting down: end the request now, as a client would see it end.

        A request still being tokenized has sent nothing yet, so it fails with ``error`` (a
        503 before any byte). One that was accepted ends like a request that reached its
        token limit: every unfinished choice finishes with "length" and keeps the text it
        has, so each API family closes its response with its usual final event. The
        generation itself is aborted at the next step boundary.
        """
        if self.done:
            return
        self.interrupted = True
        if not self._accepted.is_set():
            self.fail(error)
        else:
            for i, c in enumerate(self._choices):
                if c.finish is None:
                    self.finish("length", choice=i)
        self._aborts.notify(self.request_id)

    @property
    def done(self) -> bool:
        return self._finished or self._error is not None or self.cancelled

    # --- consumer side ----------------------------------------------------------------------

    def track_progress(self) -> None:
        """Keep a report per prefill chunk for ``take_progress`` (llama-server's
        return_progress); call before the request can start, right after submitting it."""
        if self._progress is None:
            self._progress = []

    def take_progress(self) -> list[dict[str, float]]:
        """llama-server's `prompt_progress` objects reported since the last call, oldest first:
        ``total``, ``cache``, ``processed`` and ``time_ms`` since the request started."""
        if not self._progress:
            return []
        start = self.started_at if self.started_at is not None else self.submitted_at
        out = [
            {
                "total": self.prompt_tokens,
                "cache": self.cached_tokens,
                "processed": min(done, self.prompt_tokens),
                "time_ms": max(at - start, 0.0) * 1000.0,
            }
            for done, at in self._progress
        ]
        self._progress.clear()
        return out

    async def wait_accepted(self) -> int:
        """Wait until the prompt is tokenized; raise the request's error if it failed first.

        Cancellation: the caller is expected to call ``cancel()`` in its ``finally``.
        """
        await self._accepted.wait()
        if self._error is not None:
            raise self._error
        return self.prompt_tokens

    async def wait_placed(self, timeout: float) -> bool:  # noqa: ASYNC109 - False: ping due
        """Wait until ``cached_tokens`` is known (or the request ended); False on timeout.

        Cancellation: as ``wait_accepted``.
        """
        with trio.move_on_after(timeout):
            await self._placed.wait()
        return self._placed.is_set()

    async def next_choices(
        self,
        timeout: float = math.inf,  # noqa: ASYNC109 - returning None (keepalive due) is the point
    ) -> tuple[SlotUpdate, ...] | None:
        """One update per choice with anything new since the last call (its finish included),
        or None when ``timeout`` passes first.

        Raises the request's error. Once every choice's finishing update has been returned,
        further calls raise ``trio.EndOfChannel``.
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
        updates = tuple(c.take(i) for i, c in enumerate(self._choices) if c.has_news)
        self._delivered_finish = all(c.delivered for c in self._choices)
        return updates

    @property
    def delivered(self) -> bool:
        """Every choice's finishing update has been read."""
        return self._delivered_finish

    async def next(
        self,
        timeout: float = math.inf,  # noqa: ASYNC109 - as next_choices
    ) -> SlotUpdate | None:
        """``next_choices`` for a single-choice request: its update (possibly empty), or None
        when ``timeout`` passes first."""
        assert self.n == 1, "a multi-choice slot is read with next_choices()"
        updates = await self.next_choices(timeout)
        if updates is None:
            return None
        return updates[0] if updates else SlotUpdate("", 0, None)

    def cancel(self) -> None:
        """The reader is gone or done: stop the work if it is still going. Idempotent."""
        if not self.cancelled:
            self.cancelled = True
            if not self._finished and self._error is None:
                self._aborts.notify(self.request_id)
            self.reservation.release()
            self._on_close()
