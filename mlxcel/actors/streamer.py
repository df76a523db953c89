"""The streamer actor: token ids in, text deltas out to each request's OutputSlot.

Per request, output text goes through: incremental detokeniser -> stop strings (a match tells
the scheduler to stop the sequence through the AbortBox) -> reasoning splitter (thinking goes
to `reasoning`) -> tool-call parser (calls become events). Streaming and non-streaming answers
are built from the same events, so they always agree. It never blocks on a client: slots merge.
A request with n choices has n such pipelines, one per choice, each finishing on its own.
"""

from __future__ import annotations

import logging
import time
from typing import Any, assert_never

import attrs
import trio

from mlxcel.actors.detok import IncrementalDetokenizer, StopMatcher
from mlxcel.actors.loops import LoopDetector
from mlxcel.actors.reasoning import ReasoningDelta, ReasoningFormat, Splitter
from mlxcel.actors.toolcalls import (
    MARKER_TEXTS,
    Parser,
    TextDelta,
    ToolCallStart,
    ToolFormat,
    make_parser,
)
from mlxcel.actors.toolcalls.harmony import CHANNEL
from mlxcel.actors.toolcalls.harmony import TOKENS as HARMONY_TOKENS
from mlxcel.runtime.errors import InternalError
from mlxcel.runtime.messages import (
    CloseStream,
    FinishReason,
    OpenStream,
    StepTokens,
    StreamerInbox,
    TokenOut,
)
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.slot import AbortBox, OutputSlot, TokenLogprob

log = logging.getLogger(__name__)


# Special tokens that output parsers read, so they must reach the text.
MARKERS = MARKER_TEXTS | {"<think>", "</think>"}


def hidden_special_tokens(tokenizer: Any) -> frozenset[int] | None:
    """Ids of the special tokens to leave out of output text: all but the parsers' markers,
    and in a harmony vocabulary (gpt-oss: <|channel|> is a token) all of harmony's framing,
    which its channels are read from (other vocabularies' <|end|> stays hidden)."""
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict):
        return None
    special = {str(t) for t in added.values() if getattr(t, "special", False)}
    keep = MARKERS | set(HARMONY_TOKENS) if CHANNEL in special else MARKERS
    return frozenset(
        i for i, t in added.items() if getattr(t, "special", False) and str(t) not in keep
    )


@attrs.define
class _Stream:
    slot: OutputSlot
    choice: int
    detok: IncrementalDetokenizer
    stops: StopMatcher
    reasoning: Splitter | None = None
    tools: Parser | None = None
    single_call: bool = False
    calls: int = 0
    last_token_at: float | None = None
    loops: LoopDetector | None = None


class Streamer:
    def __init__(
        self,
        tokenizer: Any,
        eos_token_ids: frozenset[int],
        inbox: trio.MemoryReceiveChannel[StreamerInbox],
        aborts: AbortBox,
        metrics: Metrics | None = None,
        *,
        reasoning: ReasoningFormat | None = None,
        tool_format: ToolFormat | None = None,
    ) -> None:
        self._metrics = metrics or Metrics()
        self._tokenizer = tokenizer
        self._eos = eos_token_ids
        self._inbox = inbox
        self._aborts = aborts
        self._reasoning = reasoning
        self._tool_format = tool_format
        self._hidden = hidden_special_tokens(tokenizer)
        # Per request, its choices' pipelines; None once a choice has finished.
        self._streams: dict[str, list[_Stream | None]] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Serve the inbox until it closes. On cancellation, open slots are left as they are:
        their handlers are being cancelled by the same shutdown."""
        task_status.started()
        async for msg in self._inbox:
            self.handle(msg)

    def handle(self, msg: StreamerInbox) -> None:
        match msg:
            case OpenStream():
                self._open(msg)
            case StepTokens(tokens):
                for t in tokens:
                    self._token(t)
            case CloseStream(request_id, reason, error):
                for stream in self._streams.pop(request_id, []):
                    if stream is None:
                        continue
                    self._metrics.requests.labels(reason).inc()
                    if error is not None:
                        stream.slot.fail(InternalError(error))
                    else:
                        stream.slot.finish(reason, choice=stream.choice)
            case _:
                assert_never(msg)

    def _open(self, msg: OpenStream) -> None:
        streams: list[_Stream | None] = [self._pipeline(msg, i) for i in range(msg.n)]
        self._streams[msg.request_id] = streams

    def _pipeline(self, msg: OpenStream, choice: int) -> _Stream:
        parser = None
        if msg.parse_tools and self._tool_format is not None:
            parser = make_parser(self._tool_format, tools=msg.tools)
        splitter = None
        if self._reasoning is not None:
            splitter = self._reasoning.splitter(
                starts_open=msg.reasoning_open, calls=parser is not None
            )
        return _Stream(
            msg.slot,
            choice,
            IncrementalDetokenizer(self._tokenizer, msg.prompt_tail, self._hidden),
            StopMatcher(msg.stop),
            splitter,
            parser,
            msg.single_tool_call,
            loops=LoopDetector(msg.loop_limit) if msg.loop_limit is not None else None,
        )

    def _token(self, t: TokenOut) -> None:
        streams = self._streams.get(t.request_id)
        stream = streams[t.choice] if streams is not None and t.choice < len(streams) else None
        if streams is None or stream is None:
            return  # already finished by a stop string, or aborted
        now = time.monotonic()
        if stream.last_token_at is None:
            if t.choice == 0:  # one time-to-first-token per request
                self._metrics.ttft.observe(now - stream.slot.submitted_at)
        else:
            self._metrics.inter_token.observe(now - stream.last_token_at)
        stream.last_token_at = now
        lp = None
        # A loop is cut where it is found, like a stop string (the loop's text stays shown).
        looped = t.finish_reason is None and stream.loops is not None and stream.loops.feed(t.token)
        if t.finish_reason == "stop" and t.token in self._eos:
            text, n = stream.detok.flush(), 0
        else:
            text, n = stream.detok.add(t.token), 1
            if t.finish_reason is not None or looped:
                text += stream.detok.flush()
            if t.logprob is not None:
                lp = TokenLogprob(t.token, t.logprob, t.top_logprobs)
        emit, matched = stream.stops.feed(text)
        final = matched is not None or t.finish_reason is not None or looped
        if final and matched is None:
            emit += stream.stops.flush()
        self._route(stream, emit, final, cut=matched is None and t.finish_reason == "length")
        stream.slot.push("", n, lp, choice=t.choice, token=t.token if n else None)
        if not final:
            return
        streams[t.choice] = None
        siblings = any(s is not None for s in streams)
        if not siblings:
            del self._streams[t.request_id]
        reason: FinishReason = "stop" if matched is not None else t.finish_reason or "stop"
        if reason == "stop" and stream.calls:
            reason = "tool_calls"
        stream.slot.finish(reason, stop_word=matched, choice=t.choice)
        self._metrics.requests.labels(reason).inc()
        if matched is not None or looped:
            # The model does not know about stop strings or loops: stop the sequence (only
            # this choice while its siblings go on).
            if siblings:
                self._aborts.notify_choice(t.request_id, t.choice)
            else:
                self._aborts.notify(t.request_id)

    def _route(self, stream: _Stream, text: str, final: bool, cut: bool = False) -> None:
        """Split thinking from the answer, then tool calls from the answer's text; ``cut``: the
        token budget ended the output, so a call being written comes out as far as it got."""
        pieces: list[ReasoningDelta | TextDelta] = [TextDelta(text)] if text else []
        if stream.reasoning is not None:
            pieces = stream.reasoning.feed(text) if text else []
            if final:
                pieces += stream.reasoning.finish()
        for piece in pieces:
            if isinstance(piece, ReasoningDelta):
                stream.slot.push_reasoning(piece.text, choice=stream.choice)
            elif stream.tools is None:
                stream.slot.push(piece.text, 0, choice=stream.choice)
            else:
                self._tool_events(stream, stream.tools.feed(piece.text))
        if final and stream.tools is not None:
            self._tool_events(stream, stream.tools.finish(cut=cut))

    def _tool_events(self, stream: _Stream, events: list[Any]) -> None:
        for event in events:
            if isinstance(event, TextDelta):
                stream.slot.push(event.text, 0, choice=stream.choice)
                continue
            if stream.single_call and event.index > 0:
                continue  # parallel_tool_calls: false keeps the first call only
            if isinstance(event, ToolCallStart):
                stream.calls += 1
            stream.slot.push_tool_event(event, choice=stream.choice)
