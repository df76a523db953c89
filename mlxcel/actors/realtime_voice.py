"""The realtime-voice actor: one per WebSocket session, a cascaded speech-to-speech pipeline.

    client --append/commit--> reader --(VAD, buffer)--> jobs => responder
                                                               | Whisper (stt actor)
                                                               | LLM via admission (batched
                                                               |   with HTTP traffic)
                                                               | sentences -> Piper (tts actor)
    client <--------------- writer <== outbox <-----------------+ events, audio deltas

The session's nursery holds the reader, the writer and the responder; each answer runs in its
own CancelScope so barge-in (VAD speech start while answering), ``response.cancel`` and a new
commit stop it at once: its generation is aborted like a disconnected HTTP request, its unsent
audio is purged from the outbox, and the assistant turn kept in the history is cut to the
pieces whose audio reached the client.

Bounds: the input buffer holds at most ``max_buffer_seconds`` of uncommitted audio (an append
beyond it is refused with an error); at most ``MAX_PENDING_JOBS`` turns wait for the responder;
the outbox holds at most ``max_outbox_bytes`` (a client that falls that far behind is
disconnected with 1008 rather than slowing anyone else). Cancellation of ``run`` (the client
went away, the server stops) aborts the running answer and returns.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from typing import Any, Protocol, cast

import attrs
import numpy as np
import trio

from mlxcel.actors.admission import Admission
from mlxcel.actors.audio.worker import AudioWorker
from mlxcel.actors.realtime.audio import (
    FRAME_SAMPLES,
    STT_RATE,
    AudioFormatError,
    InputBuffer,
    Resampler,
    decode_pcm16,
    encode_pcm16,
)
from mlxcel.actors.realtime.config import (
    CONFIGURE_TIMEOUT_SECONDS,
    ProtocolError,
    ResponseState,
    SessionConfig,
    new_id,
)
from mlxcel.actors.realtime.outbox import Outbox, OutboxOverflow
from mlxcel.actors.realtime.sentences import SentenceSplitter
from mlxcel.actors.realtime.vad import SileroModel, VadStream
from mlxcel.runtime import json_input
from mlxcel.runtime.errors import InvalidRequest, MlxcelError
from mlxcel.runtime.messages import ChatPrompt, GenerationRequest, SamplingParams
from mlxcel.runtime.truncation import budget, first_kept

log = logging.getLogger(__name__)

MAX_PENDING_JOBS = 4
# A memory bound on the conversation (a 600 s session at one turn every 5 s holds 240 items).
# Past it the oldest quarter goes at once, so the prompt's start stays put between drops.
MAX_HISTORY_ITEMS = 256
# Longest audio delta sent in one event, in seconds (finer pieces start playback sooner and
# let barge-in drop more of what was not heard).
AUDIO_DELTA_SECONDS = 0.25
# How far ahead of the client's playback an answer is spoken. Speech costs ~0.17 s of CPU per
# second of audio here, and a barge-in throws away whatever was spoken but not yet heard, so
# an answer is synthesized only this far ahead: enough to ride out a busy moment, while the
# CPU goes to turns that are waiting for their first word.
SPEAK_AHEAD_SECONDS = 2.5
# Speak the words there are (not the whole sentence) when the client's audio runs out sooner.
HURRY_SECONDS = 1.5


class Transport(Protocol):
    async def receive(self) -> str | bytes: ...
    async def send(self, data: str) -> None: ...
    async def close(self, code: int, reason: str) -> None: ...


class SpeechToText(Protocol):
    async def transcribe(
        self,
        audio: np.ndarray,
        *,
        language: str | None = ...,
        prompt: str | None = ...,
        greedy: bool = ...,
    ) -> Any: ...


class TextToSpeech(Protocol):
    @property
    def sample_rate(self) -> int: ...

    def voice_for(self, voice: str | None) -> str: ...

    def synthesize(
        self,
        text: str,
        *,
        voice: str | None = ...,
        speed: float = ...,
        deadline: float | None = ...,
    ) -> AsyncIterator[bytes]: ...


@attrs.frozen
class VoiceDeps:
    """What a session needs from the running server."""

    admission: Admission
    stt: SpeechToText
    tts: TextToSpeech
    sampling: SamplingParams
    model_id: str
    vad_model: Callable[[], SileroModel]
    # A shared limiter for VAD work in threads (so many sessions cannot flood the pool).
    vad_limiter: trio.CapacityLimiter
    max_buffer_seconds: float = 120.0
    max_outbox_bytes: int = 8 * 1024 * 1024
    # Prompt tokens of a request, rendered and encoded as generation will (blocking: called
    # in a thread), and the context window; without them no truncation happens.
    count_tokens: Callable[[GenerationRequest], int] | None = None
    context_length: int = 0


@attrs.define
class Item:
    id: str
    role: str
    text: str


@attrs.define(eq=False)
class EarlyTranscript:
    """A transcription started at a VAD pause, while the silence that ends the turn is still
    being waited out: when the turn does end there, its transcript is (nearly) ready. Speech
    coming back cancels it; the audio after the pause is silence, so it reads the same."""

    item_id: str
    scope: trio.CancelScope = attrs.field(factory=trio.CancelScope)
    done: trio.Event = attrs.field(factory=trio.Event)
    result: Any = None  # None: cancelled or failed (the turn then transcribes itself)


@attrs.frozen
class Turn:
    """Committed user audio: transcribe it, then answer if ``respond``."""

    item_id: str
    audio: np.ndarray = attrs.field(eq=False)
    respond: bool
    early: EarlyTranscript | None = attrs.field(default=None, eq=False)


@attrs.frozen
class Respond:
    """``response.create``: answer from the conversation as it is."""

    instructions: str | None = None
    output_audio: bool | None = None
    max_output_tokens: int | None = None


@attrs.frozen
class AddItem:
    item: Item


Job = Turn | Respond | AddItem


class RealtimeSession:
    def __init__(self, transport: Transport, deps: VoiceDeps, dialect: Any) -> None:
        self.id = new_id("sess")
        self._t = transport
        self._deps = deps
        self._d = dialect
        self.cfg: SessionConfig = dialect.initial_config(deps.model_id)
        self._configured = not dialect.needs_configure
        self._out = Outbox(deps.max_outbox_bytes)
        self._buffer = InputBuffer(deps.max_buffer_seconds)
        self._resampler: Resampler | None = None
        self._resampler_rate = STT_RATE
        self._vad: VadStream | None = None
        self._speech_item: str | None = None
        self._early: EarlyTranscript | None = None
        self._jobs_tx, self._jobs_rx = trio.open_memory_channel[Job](MAX_PENDING_JOBS)
        self._history: list[Item] = []
        # The first item of ``_history`` the model reads (``truncation``: runtime/truncation.py).
        self._context_from = 0
        self._active: tuple[ResponseState, trio.CancelScope] | None = None
        self._started = trio.current_time()
        self._last_activity = self._started
        self._nursery: trio.Nursery | None = None
        # End-of-speech times (monotonic) of turns, for latency accounting in logs.
        self.turn_ended_at: float | None = None

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the session until it closes (client, timeout, cap) or is cancelled.

        Cancellation aborts the running answer (its generation is aborted at the next step)
        and returns without closing the WebSocket (the caller owns it).
        """
        self._emit(*self._d.session_created(self.id, self.cfg))
        if self._configured:
            self._vad_changed()
        try:
            async with trio.open_nursery() as n:
                self._nursery = n
                n.start_soon(self._writer)
                n.start_soon(self._reader)
                n.start_soon(self._responder)
        except* OutboxOverflow as group:
            log.warning("realtime %s dropped: %s", self.id, group.exceptions[0])
            with trio.move_on_after(1) as s:
                s.shield = True
                await self._t.close(1008, "client too slow: outgoing queue overflow")

    def shut_down(self) -> None:
        """The server is stopping: end the running answer, say why, then close 1001 (going
        away). Sync and idempotent; called from outside the session's nursery."""
        try:
            self._cancel_response("server_shutting_down")
            self._error("server_shutting_down", "The server is shutting down.")
        except OutboxOverflow:
            pass  # the client is too far behind to read it: the close is all it gets
        self._close(1001, "server shutting down")

    def _emit(self, *payloads: dict[str, Any], response_id: str | None = None) -> None:
        for p in payloads:
            self._out.put(self._stamp(p), response_id=response_id)

    def _stamp(self, payload: dict[str, Any]) -> dict[str, Any]:
        payload = {**payload, "event_id": new_id("event")}
        if self._d.frame_index:
            payload["frame_index"] = self._buffer.total_samples // FRAME_SAMPLES
        return payload

    def _error(self, code: str, message: str, param: str | None = None) -> None:
        self._emit(self._d.error(code, message, param))

    def _close(self, code: int, reason: str) -> None:
        self._out.close(code, reason)

    async def _writer(self) -> None:
        while True:
            item = await self._out.get()
            if isinstance(item, tuple):
                code, reason = item
                with trio.move_on_after(5):
                    await self._t.close(code, reason)
                assert self._nursery is not None
                self._nursery.cancel_scope.cancel()
                return
            await self._t.send(item.text)

    # --- reader: every client event, never blocked by model work ---------------------------

    def _deadline(self) -> float:
        if not self._configured:
            return self._started + CONFIGURE_TIMEOUT_SECONDS
        return min(
            self._last_activity + self.cfg.idle_timeout, self._started + self.cfg.max_seconds
        )

    async def _reader(self) -> None:
        while self._out.closing is None:
            message: str | bytes | None = None
            with trio.move_on_at(self._deadline()):
                message = await self._t.receive()
            if message is None:
                self._timed_out()
                continue
            self._last_activity = trio.current_time()
            if isinstance(message, bytes):
                self._error("invalid_request", "message must be a JSON object")
                continue
            try:
                event = json_input.loads(message, where="the event")
            except InvalidRequest as error:  # not JSON, too deep, or a lone surrogate
                self._error("invalid_request", error.message, error.param)
                continue
            if not isinstance(event, dict):
                self._error("invalid_request", "message must be a JSON object")
                continue
            try:
                await self._handle(event)
            except ProtocolError as error:
                self._error(error.code, error.message, error.param)

    def _timed_out(self) -> None:
        now = trio.current_time()
        if not self._configured:
            self._error("invalid_request", "send session.update within 30 s of connecting")
            self._close(1008, "session not configured in time")
        elif now >= self._started + self.cfg.max_seconds:
            self._error("session_expired", f"session reached its {self.cfg.max_seconds:g} s cap")
            self._close(1008, "session time cap reached")
        else:
            self._error("idle_timeout", f"no client event for {self.cfg.idle_timeout:g} s")
            self._close(1008, "idle timeout")

    async def _handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "session.update":
            self._update(event.get("session"))
        elif kind == "session.ping":
            self._emit(*self._d.pong())
        elif kind == "session.cancel":
            self._cancel_response("client_cancelled", always_report=True)
            self._close(1000, "session cancelled")
        elif kind == "response.cancel":
            if self._active is None and self.cfg.multi_turn:
                raise ProtocolError("no response is in progress", code="response_cancel_not_active")
            self._cancel_response("client_cancelled", always_report=not self.cfg.multi_turn)
            if not self.cfg.multi_turn:
                self._close(1000, "response cancelled")
        elif not self._configured:
            raise ProtocolError("send session.update before audio")
        elif kind == "input_audio_buffer.append":
            await self._append(event)
        elif kind == "input_audio_buffer.commit":
            self._commit()
        elif kind == "input_audio_buffer.clear":
            self._drop_early()
            self._buffer.clear()
            if self._vad is not None:
                self._vad.reset()
            self._speech_item = None
            self._emit(*self._d.cleared())
        elif kind == "response.create":
            self._queue(_respond_job(event.get("response")))
        elif kind == "conversation.item.create":
            self._queue(AddItem(_item(event.get("item"))))
        else:
            raise ProtocolError(f"unsupported event type '{kind}'")

    def _update(self, session: object) -> None:
        first = not self._configured
        cfg = attrs.evolve(self.cfg)
        try:
            self._d.apply_update(cfg, session, first=first)
        except ProtocolError as error:
            if first and self._d.needs_configure:
                error.code = "session_initialization_failed"
            raise
        try:
            self._deps.tts.voice_for(cfg.voice)
        except MlxcelError as error:
            raise ProtocolError(error.message, param="session.voice") from None
        vad_changed = cfg.turn_detection != self.cfg.turn_detection or first
        self.cfg = cfg
        self._configured = True
        if vad_changed:
            self._vad_changed()
        self._emit(*self._d.session_updated(self.id, self.cfg))

    def _vad_changed(self) -> None:
        td = self.cfg.turn_detection
        self._vad = (
            None
            if td is None
            else VadStream(
                self._deps.vad_model(),
                threshold=td.threshold,
                silence_ms=td.silence_duration_ms,
                start=self._buffer.total_samples,
            )
        )
        self._speech_item = None
        self._drop_early()

    async def _append(self, event: dict[str, Any]) -> None:
        rate = (
            event.get("sample_rate", self.cfg.input_rate)
            if self._d.name == "voicechat"
            else self.cfg.input_rate
        )
        if isinstance(rate, bool) or not isinstance(rate, int) or not 8000 <= rate <= 48000:
            raise ProtocolError(
                "'sample_rate' must be an integer in 8000..48000", param="sample_rate"
            )
        try:
            pcm = decode_pcm16(event.get("audio"))
        except AudioFormatError as error:
            raise ProtocolError(str(error), code="inference_error", param="audio") from None
        if rate != STT_RATE:
            if self._resampler is None or self._resampler_rate != rate:
                self._resampler, self._resampler_rate = Resampler(rate, STT_RATE), rate
            pcm = self._resampler.push(pcm)
        if not self._buffer.fits(pcm.size):
            raise ProtocolError(
                f"input audio buffer is full ({self._deps.max_buffer_seconds:g} s of "
                "uncommitted audio): commit or clear it; this audio was dropped",
                code="input_audio_buffer_full",
            )
        self._buffer.append(pcm)
        if self._vad is not None:
            await self._detect(pcm)

    async def _detect(self, pcm: np.ndarray) -> None:
        vad, td = self._vad, self.cfg.turn_detection
        assert vad is not None and td is not None
        audio = pcm.astype(np.float32) / 32768.0
        events = await trio.to_thread.run_sync(vad.feed, audio, limiter=self._deps.vad_limiter)
        for ev in events:
            ms = ev.sample * 1000 // STT_RATE
            if ev.kind == "start":
                self._speech_item = new_id("item")
                self._emit(*self._d.speech_started(self._speech_item, ms))
                if td.interrupt_response:
                    self._cancel_response("turn_detected")
                # Keep the speech and the padding before it; drop older silence.
                pad = td.prefix_padding_ms * STT_RATE // 1000
                self._buffer.drop_front(ev.sample - pad - self._buffer.start_sample)
            elif ev.kind == "pause" and self._speech_item is not None:
                self._start_early(self._speech_item)
            elif ev.kind == "resume":
                self._drop_early()
            elif ev.kind == "stop" and self._speech_item is not None:
                self._emit(*self._d.speech_stopped(self._speech_item, ms))
                self.turn_ended_at = trio.current_time()
                self._commit(self._speech_item, respond=td.create_response)
        if not vad.speaking:
            # Between turns only the padding before the next speech start is worth keeping.
            pad = td.prefix_padding_ms * STT_RATE // 1000 + 2 * 512
            self._buffer.drop_front(self._buffer.samples - pad)

    def _commit(self, item_id: str | None = None, *, respond: bool | None = None) -> None:
        if self._buffer.samples < STT_RATE // 10:
            raise ProtocolError(
                "input audio buffer holds less than 100 ms of audio: nothing to commit",
                code="input_audio_buffer_commit_empty",
            )
        if item_id is None:
            self.turn_ended_at = trio.current_time()
        item_id = item_id or new_id("item")
        early, self._early = self._early, None
        if early is not None and early.item_id != item_id:
            early.scope.cancel()
            early = None
        previous = self._history[-1].id if self._history else None
        audio = self._buffer.take()
        if self._vad is not None:
            self._vad.reset()
        self._speech_item = None
        self._emit(*self._d.committed(item_id, previous))
        self._emit(*self._d.user_item(item_id, previous, None))
        if respond is None:
            # A manual commit answers unless server VAD is on with create_response off.
            respond = self.cfg.turn_detection is None or self.cfg.turn_detection.create_response
        # The user spoke again: whatever was being answered is stale (unless VAD is told not to
        # interrupt answers; then the new turn waits for the running one).
        td = self.cfg.turn_detection
        if td is None or td.interrupt_response:
            self._cancel_response("turn_detected")
        self._queue(Turn(item_id, audio, respond, early))

    def _start_early(self, item_id: str) -> None:
        self._drop_early()
        early = self._early = EarlyTranscript(item_id)
        assert self._nursery is not None
        self._nursery.start_soon(self._transcribe_early, early, self._buffer.peek())

    def _drop_early(self) -> None:
        if self._early is not None:
            self._early.scope.cancel()
            self._early = None

    async def _transcribe_early(self, early: EarlyTranscript, audio: np.ndarray) -> None:
        try:
            with early.scope:
                early.result = await self._stt(audio)
        except MlxcelError:
            pass  # the turn, if it ends, transcribes itself and reports the error
        finally:
            early.done.set()

    async def _stt(self, audio: np.ndarray) -> Any:
        return await self._deps.stt.transcribe(
            audio,
            language=self.cfg.language,
            prompt=self.cfg.transcription_prompt,
            greedy=True,  # a live turn waits on this: no beam search, a short window
        )

    def _queue(self, job: Job) -> None:
        try:
            self._jobs_tx.send_nowait(job)
        except trio.WouldBlock:
            raise ProtocolError(
                f"more than {MAX_PENDING_JOBS} turns are waiting to be answered; this one was "
                "dropped",
                code="server_busy",
            ) from None

    def _cancel_response(self, reason: str, *, always_report: bool = False) -> None:
        """Stop the running answer now: its unsent audio is dropped and its end is reported
        before anything else the session sends (so a close right after still carries it)."""
        if self._active is not None:
            r, scope = self._active
            if r.status == "in_progress":
                r.status, r.reason = "cancelled", reason
                dropped = self._out.purge(r.id)
                if dropped:
                    r.spoken_pieces = r.spoken_pieces[: min(dropped)]
            self._end_response(r)
            scope.cancel()
        elif always_report:
            r = ResponseState(new_id("resp"), new_id("item"), False, status="cancelled")
            r.reason = reason
            self._emit(*self._d.response_done(r))

    def _end_response(self, r: ResponseState) -> None:
        """Report a finished answer and keep what the user heard of it (once per answer)."""
        self._active = None
        if r.heard:
            self._remember(Item(r.item_id, "assistant", r.heard))
        self._emit(*self._d.response_done(r))

    # --- responder: transcription and answers, one job at a time ----------------------------

    async def _responder(self) -> None:
        async for job in self._jobs_rx:
            match job:
                case Turn(item_id, audio, respond, early):
                    text = await self._transcribe(item_id, audio, early)
                    if text and respond:
                        await self._respond(Respond())
                    elif not self.cfg.multi_turn and self._out.closing is None:
                        self._close(1000, "turn complete")
                case Respond():
                    await self._respond(job)
                case AddItem(item):
                    previous = self._history[-1].id if self._history else None
                    self._remember(item)
                    if item.role == "user":
                        self._emit(*self._d.user_item(item.id, previous, item.text))

    async def _transcribe(
        self, item_id: str, audio: np.ndarray, early: EarlyTranscript | None
    ) -> str:
        result = None
        if early is not None:
            await early.done.wait()
            result = early.result
        if result is None:
            try:
                result = await self._stt(audio)
            except MlxcelError as error:
                self._error("inference_error", f"transcription failed: {error.message}")
                return ""
        text = str(result.text).strip()
        self._emit(*self._d.transcript(item_id, text))
        if text:
            self._remember(Item(item_id, "user", text))
        return text

    def _remember(self, item: Item) -> None:
        self._history.append(item)
        if len(self._history) > MAX_HISTORY_ITEMS:
            drop = MAX_HISTORY_ITEMS // 4
            del self._history[:drop]
            self._context_from = max(0, self._context_from - drop)

    def _messages(self, instructions: str | None) -> tuple[dict[str, object], ...]:
        """The prompt: the instructions, then the items the model reads (from the cut on)."""
        return _prompt(self._system(instructions), self._history[self._context_from :])

    def _system(self, instructions: str | None) -> str:
        return instructions if instructions is not None else self.cfg.instructions

    def _fit_context(self, request: GenerationRequest, system: str, items: list[Item]) -> int:
        """Where the cut goes for this prompt (runtime/truncation.py). Runs in a thread: it
        encodes the prompt once, and ~log2(items) more times when it cuts; ``items`` is a
        snapshot."""
        count, truncation = self._deps.count_tokens, self.cfg.truncation
        if count is None or truncation is None or not self._deps.context_length:
            return self._context_from

        def tokens(start: int) -> int:
            prompt = ChatPrompt(messages=_prompt(system, items[start:]))
            return count(attrs.evolve(request, prompt=prompt))

        # No instructions: nothing precedes the conversation (a prompt of no messages cannot
        # be rendered, and every answer of such a session failed).
        base = tokens(len(items)) if system else 0
        limit = budget(
            truncation,
            context=self._deps.context_length,
            instructions=base,
            max_output=request.max_tokens,
        )
        return first_kept(
            len(items),
            self._context_from,
            lambda k: tokens(k) - base,
            limit,
            truncation.retention_ratio,
        )

    async def _respond(self, job: Respond) -> None:
        cfg = self.cfg
        audio = cfg.output_audio if job.output_audio is None else job.output_audio
        r = ResponseState(new_id("resp"), new_id("item"), audio)
        with trio.CancelScope() as scope:
            self._active = (r, scope)
            self._emit(*self._d.response_created(r))
            try:
                await self._generate(r, job)
                if r.status == "in_progress":
                    r.status = "completed"
            except MlxcelError as error:
                if r.status == "in_progress":
                    r.status, r.reason = "failed", error.error_type
                    self._error("inference_error", f"answer failed: {error.message}")
            finally:
                if self._active is not None and self._active[0] is r:
                    if r.status == "in_progress":
                        r.status, r.reason = "cancelled", "session_closed"
                    self._end_response(r)
        if not cfg.multi_turn and r.status != "cancelled":
            self._close(1000, "turn complete")

    async def _generate(self, r: ResponseState, job: Respond) -> None:
        cfg = self.cfg
        sampling = self._deps.sampling
        if cfg.temperature is not None:
            sampling = attrs.evolve(sampling, temperature=cfg.temperature)
        if cfg.seed is not None:
            sampling = attrs.evolve(sampling, seed=cfg.seed)
        gen = GenerationRequest(
            request_id=r.id,
            prompt=ChatPrompt(messages=()),
            sampling=sampling,
            max_tokens=job.max_output_tokens or cfg.max_output_tokens,
            cache_key="",
            # Someone is waiting in silence: the high lane, which also skips the join window.
            priority=0,
        )
        items = list(self._history)
        cut = await trio.to_thread.run_sync(
            self._fit_context, gen, self._system(job.instructions), items
        )
        if cut != self._context_from and items == self._history:
            log.info("realtime %s: the model now reads items %d.. of %d", self.id, cut, len(items))
            self._context_from = cut
        gen = attrs.evolve(gen, prompt=ChatPrompt(messages=self._messages(job.instructions)))
        slot = self._deps.admission.submit(gen)
        splitter = SentenceSplitter()
        out_rate = self.cfg.output_rate
        async with trio.open_nursery() as n:
            pieces_tx, pieces_rx = trio.open_memory_channel[str](64)
            if r.output_audio:
                n.start_soon(self._speak, r, pieces_rx)
            async with pieces_tx:
                try:
                    r.input_tokens = await slot.wait_accepted()
                    while True:
                        update = await slot.next()
                        assert update is not None
                        if update.text:
                            r.text += update.text
                            self._emit(*self._d.text_delta(r, update.text), response_id=r.id)
                            if r.output_audio:
                                hurry = _starving(r, out_rate)
                                for piece in splitter.feed(update.text, hurry=hurry):
                                    r.pieces_pending += 1
                                    await pieces_tx.send(piece)
                        if update.finish_reason is not None:
                            break
                finally:
                    r.output_tokens = slot.completion_tokens
                    slot.cancel()
                if r.output_audio and (rest := splitter.flush()):
                    r.pieces_pending += 1
                    await pieces_tx.send(rest)

    async def _speak(self, r: ResponseState, pieces: trio.MemoryReceiveChannel[str]) -> None:
        tts = self._deps.tts
        out_rate = self.cfg.output_rate
        resampler = Resampler(tts.sample_rate, out_rate) if tts.sample_rate != out_rate else None
        step = int(AUDIO_DELTA_SECONDS * out_rate)
        async for piece in pieces:
            index: int | None = None
            # The TTS worker serves the earliest deadline first: the first piece is wanted
            # now; each later one when the client will have played what came before it.
            deadline = r.playback_end(out_rate)
            if (
                deadline is not None
                and (wait := deadline - SPEAK_AHEAD_SECONDS - AudioWorker.now()) > 0
            ):
                await trio.sleep(wait)
            speech = tts.synthesize(
                piece, voice=self.cfg.voice, speed=self.cfg.speed, deadline=deadline
            )
            # An async generator: closed promptly when the answer is cancelled mid-sentence.
            async with contextlib.aclosing(cast(AsyncGenerator[bytes, None], speech)):
                async for chunk in speech:
                    pcm = np.frombuffer(chunk, dtype="<i2")
                    if resampler is not None:
                        pcm = resampler.push(pcm)
                    for start in range(0, pcm.size, step):
                        part = pcm[start : start + step]
                        first = index is None
                        if r.playback_from is None:
                            r.playback_from = AudioWorker.now()
                        if index is None:
                            # The piece counts as heard from its first audio on.
                            index = len(r.spoken_pieces)
                            r.spoken_pieces.append(piece)
                            if index == 0 and self.turn_ended_at is not None:
                                log.debug(
                                    "realtime %s: first audio %.2f s after the end of speech",
                                    self.id,
                                    trio.current_time() - self.turn_ended_at,
                                )
                            self._emit(*self._d.spoken(r, piece), response_id=r.id)
                        for payload in self._d.audio_delta(r, encode_pcm16(part.tobytes())):
                            self._out.put(
                                self._stamp(payload),
                                response_id=r.id,
                                first_of_piece=index if first else None,
                            )
                        r.audio_samples += part.size
            r.pieces_pending -= 1


def _prompt(system: str, items: list[Item]) -> tuple[dict[str, object], ...]:
    msgs: list[dict[str, object]] = [{"role": "system", "content": system}] if system else []
    msgs += [{"role": i.role, "content": i.text} for i in items]
    return tuple(msgs)


def _starving(r: ResponseState, out_rate: int) -> bool:
    """Will the client run out of this answer's audio soon, with nothing more on the way?
    Then the text-to-speech takes whatever whole words there are rather than waiting for the
    sentence to end (a gap in a spoken answer is worse than a phrase break)."""
    runs_dry = r.playback_end(out_rate)
    if runs_dry is None or r.pieces_pending > 0:
        return False
    return runs_dry - AudioWorker.now() < HURRY_SECONDS


def _respond_job(response: object) -> Respond:
    if response is None:
        return Respond()
    if not isinstance(response, dict):
        raise ProtocolError("'response' must be an object", param="response")
    job: dict[str, Any] = {}
    for key, value in response.items():
        if key == "instructions" and isinstance(value, str):
            job["instructions"] = value
        elif key == "output_modalities" and value in (["audio"], ["text"]):
            job["output_audio"] = value == ["audio"]
        elif key == "max_output_tokens" and (value == "inf" or isinstance(value, int)):
            job["max_output_tokens"] = None if value == "inf" else value
        elif key in ("conversation",) and value == "auto":
            continue
        elif key == "metadata":
            continue
        else:
            raise ProtocolError(
                f"'response.{key}' is not supported by this server", param=f"response.{key}"
            )
    return Respond(**job)


def _item(item: object) -> Item:
    if not isinstance(item, dict) or item.get("type", "message") != "message":
        raise ProtocolError("only message items can be created", param="item")
    role = item.get("role")
    if role not in ("user", "assistant", "system"):
        raise ProtocolError("'item.role' must be user, assistant or system", param="item.role")
    content = item.get("content")
    if not isinstance(content, list) or not content:
        raise ProtocolError("'item.content' must be a non-empty list", param="item.content")
    texts = []
    for part in content:
        if not isinstance(part, dict) or not isinstance(part.get("text"), str):
            raise ProtocolError(
                "only text content parts (input_text / output_text / text) are supported",
                param="item.content",
            )
        texts.append(part["text"])
    given = item.get("id")
    item_id = given if isinstance(given, str) else new_id("item")
    return Item(item_id, role, "".join(texts))


__all__ = ["RealtimeSession", "Transport", "VoiceDeps"]
