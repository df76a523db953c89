"""The streamer actor: token ids in, text deltas out to each request's OutputSlot.

It detokenises incrementally, cuts stop strings (telling the scheduler to stop the sequence
through the AbortBox) and delivers finish reasons. It never blocks on a client: slots merge.
"""

from __future__ import annotations

import logging
import time
from typing import Any, assert_never

import attrs
import trio

from mlxcel.actors.detok import IncrementalDetokenizer, StopMatcher
from mlxcel.runtime.errors import InternalError
from mlxcel.runtime.messages import CloseStream, OpenStream, StepTokens, StreamerInbox, TokenOut
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.slot import AbortBox, OutputSlot, TokenLogprob

log = logging.getLogger(__name__)


@attrs.define
class _Stream:
    slot: OutputSlot
    detok: IncrementalDetokenizer
    stops: StopMatcher
    last_token_at: float | None = None


class Streamer:
    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        inbox: trio.MemoryReceiveChannel[StreamerInbox],
        aborts: AbortBox,
        metrics: Metrics | None = None,
    ) -> None:
        self._metrics = metrics or Metrics()
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._inbox = inbox
        self._aborts = aborts
        self._streams: dict[str, _Stream] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the inbox until it closes. On cancellation, open slots are left as they are:
        their handlers are being cancelled by the same shutdown."""
        task_status.started()
        async for msg in self._inbox:
            self.handle(msg)

    def handle(self, msg: StreamerInbox) -> None:
        match msg:
            case OpenStream(request_id, slot, stop, prompt_tail):
                self._streams[request_id] = _Stream(
                    slot, IncrementalDetokenizer(self._tokenizer, prompt_tail), StopMatcher(stop)
                )
            case StepTokens(tokens):
                for t in tokens:
                    self._token(t)
            case CloseStream(request_id, reason, error):
                stream = self._streams.pop(request_id, None)
                if stream is not None:
                    self._metrics.requests.labels(reason).inc()
                    if error is not None:
                        stream.slot.fail(InternalError(error))
                    else:
                        stream.slot.finish(reason)
            case _:
                assert_never(msg)

    def _token(self, t: TokenOut) -> None:
        stream = self._streams.get(t.request_id)
        if stream is None:
            return  # already finished by a stop string, or aborted
        now = time.monotonic()
        if stream.last_token_at is None:
            self._metrics.ttft.observe(now - stream.slot.submitted_at)
        else:
            self._metrics.inter_token.observe(now - stream.last_token_at)
        stream.last_token_at = now
        lp = None
        if t.finish_reason == "stop" and t.token in self._eos:
            text, n = stream.detok.flush(), 0
        else:
            text, n = stream.detok.add(t.token), 1
            if t.finish_reason is not None:
                text += stream.detok.flush()
            if t.logprob is not None:
                lp = TokenLogprob(t.token, t.logprob, t.top_logprobs)
        emit, matched = stream.stops.feed(text)
        if matched is not None:
            stream.slot.push(emit, n, lp)
            stream.slot.finish("stop", stop_word=matched)
            self._metrics.requests.labels("stop").inc()
            del self._streams[t.request_id]
            self._aborts.notify(t.request_id)
            return
        if t.finish_reason is not None:
            emit += stream.stops.flush()
            stream.slot.push(emit, n, lp)
            stream.slot.finish(t.finish_reason)
            self._metrics.requests.labels(t.finish_reason).inc()
            del self._streams[t.request_id]
        else:
            stream.slot.push(emit, n, lp)
