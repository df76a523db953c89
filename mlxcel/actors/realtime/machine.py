"""A realtime session's decisions, as a plain state machine: inputs in, actions out.

``SessionMachine.feed(input) -> list[Action]`` holds everything the session decides: the
configuration handshake and its deadlines, the input buffer, turns (server VAD or manual
commits), early transcription, the order of turns and answers (one at a time, at most
``MAX_PENDING_JOBS`` waiting), barge-in (the answer is cancelled, its unsent audio purged, and
the history keeps what the user heard), the conversation and its truncation; an answer's own
steps (pieces to speak and when, audio deltas, what was heard) are in ``answer.py``. It does no
I/O, reads no clock (times come in the inputs) and imports nothing of Trio, so it is tested by
feeding it inputs (tests/unit/test_realtime_machine.py). ``realtime_voice.py`` runs the tasks
that read, write, detect, transcribe, generate and speak, as Hypercorn runs h11.

A job (a committed turn, ``response.create``, ``conversation.item.create``) runs until its task
reports its end, so an answer cancelled by a new turn has unwound (its generation aborted)
before the next job starts, and a job is started only once the input that queued it has been
handled (a VAD batch that stops and restarts speech cancels nothing it did not start).
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable

import attrs
import numpy as np

from mlxcel.actors.realtime import events as ev
from mlxcel.actors.realtime.answer import Answer, prompt
from mlxcel.actors.realtime.audio import STT_RATE, InputBuffer, Resampler
from mlxcel.actors.realtime.config import (
    CONFIGURE_TIMEOUT_SECONDS,
    ProtocolError,
    ResponseState,
    SessionConfig,
    SessionPatch,
    new_id,
)
from mlxcel.actors.realtime.vad import WINDOW, VadEvent
from mlxcel.runtime.messages import ChatPrompt, GenerationRequest, SamplingParams

log = logging.getLogger(__name__)

MAX_PENDING_JOBS = 4
# A memory bound on the conversation (a 600 s session at one turn every 5 s holds 240 items).
# Past it the oldest quarter goes at once, so the prompt's start stays put between drops.
MAX_HISTORY_ITEMS = 256
# And on its text: typed items (conversation.item.create) may each hold up to a WebSocket
# message (1 MiB), so the item cap alone would let a session keep 256 MiB. Past this many
# characters the oldest items go until a quarter of it is free again, for the same reason.
MAX_HISTORY_CHARS = 1_000_000
# Client events a session answers before it is configured.
_BEFORE_CONFIGURE = frozenset(
    {"session.update", "session.ping", "session.cancel", "response.cancel"}
)


@attrs.define(eq=False)
class Early:
    """A transcription started at a VAD pause, while the silence that ends the turn is still
    being waited out: when the turn does end there, its transcript is (nearly) ready. Speech
    coming back cancels it; the audio after the pause is silence, so it reads the same."""

    token: int
    item_id: str
    done: bool = False
    text: str | None = None  # None: cancelled or failed (the turn then transcribes itself)


@attrs.define(eq=False)
class Turn:
    """Committed user audio: transcribe it, then answer if ``respond``."""

    item_id: str
    audio: np.ndarray
    respond: bool
    early: Early | None = None


Job = Turn | ev.CreateResponse | ev.CreateItem


class SessionMachine:
    def __init__(
        self,
        *,
        session_id: str,
        config: SessionConfig,
        needs_configure: bool,
        sampling: SamplingParams,
        now: float,
        max_buffer_seconds: float = 120.0,
        voice_error: Callable[[str | None], str | None] = lambda voice: None,
        ids: Callable[[str], str] = new_id,
    ) -> None:
        self.id = session_id
        self.cfg = config
        self.configured = not needs_configure
        self._needs_configure = needs_configure
        self._sampling = sampling
        self._voice_error = voice_error
        self._ids = ids
        self._max_buffer_seconds = max_buffer_seconds
        self.buffer = InputBuffer(max_buffer_seconds)
        self._resampler: Resampler | None = None
        self._resampler_rate = STT_RATE
        self._vad_on = False
        self._speaking = False
        self._speech_item: str | None = None
        self._early: Early | None = None
        self._earlies: dict[int, Early] = {}
        self._next_token = 0
        self._jobs: collections.deque[Job] = collections.deque()
        self._job: Job | None = None
        self._answer: Answer | None = None  # the running job's answer, until its task ends
        self._active: Answer | None = None  # ... while it is in progress
        self.history: list[ev.Item] = []
        self._history_chars = 0  # the text in ``history``
        # The first item of ``history`` the model reads (``truncation``: runtime/truncation.py).
        self.context_from = 0
        self._started = now
        self._last_activity = now
        self.closing: tuple[int, str] | None = None
        # When the last turn's speech ended (Trio's clock), for latency accounting in logs.
        self.turn_ended_at: float | None = None
        self._actions: list[ev.Action] = []

    # --- the interface -------------------------------------------------------------------------

    def start(self) -> list[ev.Action]:
        """The session opened: announce it (and start VAD where no configuration is awaited)."""
        self._send(ev.SessionCreated(self.id, self.cfg))
        if self.configured:
            self._vad_changed()
        return self._take()

    @property
    def deadline(self) -> float:
        """When the session times out unless a client event comes (Trio's clock)."""
        if not self.configured:
            return self._started + CONFIGURE_TIMEOUT_SECONDS
        return min(
            self._last_activity + self.cfg.idle_timeout, self._started + self.cfg.max_seconds
        )

    def feed(self, event: ev.Input) -> list[ev.Action]:
        match event:
            case ev.Received(message, now):
                self._last_activity = now
                self._guard(self._received, message, now)
            case ev.TimedOut(now):
                self._timed_out(now)
            case ev.SpeechDetected(found, now):
                self._guard(self._detected, found, now)
            case ev.DetectionFailed(message):
                self._error("inference_error", f"speech detection failed: {message}")
            case ev.EarlyTranscribed(token, text):
                self._early_done(token, text)
            case ev.Transcribed(item_id, text, error):
                self._transcribed(item_id, text, error)
            case ev.ResponseEnded():
                self._response_ended(event)
            case (
                ev.ContextFitted()
                | ev.Accepted()
                | ev.Generated()
                | ev.Usage()
                | ev.GenerationDone()
                | ev.SpeakNext()
                | ev.Synthesized()
                | ev.PieceDone()
                | ev.Written()
            ):
                if (a := self._live(event.response_id)) is not None:
                    self._answering(event, a)
            case ev.ShutDown():
                self._cancel_response("server_shutting_down")
                self._error("server_shutting_down", "The server is shutting down.")
                self._close(1001, "server shutting down")
        self._pump()
        return self._take()

    # --- output --------------------------------------------------------------------------------

    def _take(self) -> list[ev.Action]:
        actions, self._actions = self._actions, []
        return actions

    def _do(self, action: ev.Action) -> None:
        self._actions.append(action)

    def _send(
        self,
        event: ev.ServerEvent,
        *,
        response_id: str | None = None,
        first_of_piece: int | None = None,
    ) -> None:
        if self.closing is None:  # after a close nothing more goes out
            self._do(ev.Send(event, self.buffer.total_samples, response_id, first_of_piece))

    def _error(self, code: str, message: str, param: str | None = None) -> None:
        self._send(ev.Error(code, message, param))

    def _close(self, code: int, reason: str) -> None:
        if self.closing is None:
            self.closing = (code, reason)
            self._do(ev.Close(code, reason))

    def _guard(self, handle: Callable[..., None], *args: object) -> None:
        """A refused client event becomes an ``error`` event; the session goes on."""
        try:
            handle(*args)
        except ProtocolError as error:
            self._error(error.code, error.message, error.param)

    # --- client events -------------------------------------------------------------------------

    def _received(self, message: ev.ClientMessage, now: float) -> None:
        match message:
            case ev.Refused():
                self._refused(message)
            case ev.UpdateSession(patch):
                self._update(patch)
            case ev.Ping():
                self._send(ev.Pong())
            case ev.CancelSession():
                self._cancel_response("client_cancelled", always_report=True)
                self._close(1000, "session cancelled")
            case ev.CancelResponse():
                if self._active is None and self.cfg.multi_turn:
                    raise ProtocolError(
                        "no response is in progress", code="response_cancel_not_active"
                    )
                self._cancel_response("client_cancelled", always_report=not self.cfg.multi_turn)
                if not self.cfg.multi_turn:
                    self._close(1000, "response cancelled")
            case _ if not self.configured:
                raise ProtocolError("send session.update before audio")
            case ev.AppendAudio(pcm, rate):
                self._append(pcm, self.cfg.input_rate if rate is None else rate)
            case ev.CommitAudio():
                self._commit(now)
            case ev.ClearAudio():
                self._drop_early()
                self.buffer.clear()
                if self._vad_on:
                    self._do(ev.ResetDetector())
                    self._speaking = False
                self._speech_item = None
                self._send(ev.Cleared())
            case ev.CreateResponse() | ev.CreateItem():
                self._queue(message)

    def _refused(self, r: ev.Refused) -> None:
        """The error a client event that could not be parsed gets: the one its state gives
        first (as for a well-formed event), else its own."""
        if r.event and r.kind == "session.update" and self._needs_configure:
            if self.configured:
                self._update(SessionPatch())  # refuses a second configuration
            raise ProtocolError(r.message, code="session_initialization_failed", param=r.param)
        if r.event and r.kind not in _BEFORE_CONFIGURE and not self.configured:
            raise ProtocolError("send session.update before audio")
        raise ProtocolError(r.message, code=r.code, param=r.param)

    def _update(self, patch: SessionPatch) -> None:
        first = not self.configured
        if not first and self._needs_configure:
            raise ProtocolError(
                "the session is already configured", code="session_initialization_failed"
            )
        cfg = attrs.evolve(self.cfg)
        patch.apply(cfg)
        if (message := self._voice_error(cfg.voice)) is not None:
            raise ProtocolError(message, param="session.voice")
        vad_changed = cfg.turn_detection != self.cfg.turn_detection or first
        self.cfg = cfg
        self.configured = True
        if vad_changed:
            self._vad_changed()
        self._send(ev.SessionUpdated(self.id, self.cfg))

    def _vad_changed(self) -> None:
        td = self.cfg.turn_detection
        self._do(ev.SetDetector(td, self.buffer.total_samples))
        self._vad_on = td is not None
        self._speaking = False
        self._speech_item = None
        self._drop_early()

    def _timed_out(self, now: float) -> None:
        if not self.configured:
            self._error("invalid_request", "send session.update within 30 s of connecting")
            self._close(1008, "session not configured in time")
        elif now >= self._started + self.cfg.max_seconds:
            self._error("session_expired", f"session reached its {self.cfg.max_seconds:g} s cap")
            self._close(1008, "session time cap reached")
        else:
            self._error("idle_timeout", f"no client event for {self.cfg.idle_timeout:g} s")
            self._close(1008, "idle timeout")

    # --- input audio and turns -----------------------------------------------------------------

    def _append(self, pcm: np.ndarray, rate: int) -> None:
        if rate != STT_RATE:
            if self._resampler is None or self._resampler_rate != rate:
                self._resampler, self._resampler_rate = Resampler(rate, STT_RATE), rate
            pcm = self._resampler.push(pcm)
        if not self.buffer.fits(pcm.size):
            raise ProtocolError(
                f"input audio buffer is full ({self._max_buffer_seconds:g} s of "
                "uncommitted audio): commit or clear it; this audio was dropped",
                code="input_audio_buffer_full",
            )
        self.buffer.append(pcm)
        if self._vad_on:
            self._do(ev.DetectSpeech(pcm))

    def _detected(self, found: tuple[VadEvent, ...], now: float) -> None:
        td = self.cfg.turn_detection
        assert self._vad_on and td is not None
        # Whether the stream is inside speech once it has read this audio (a commit below
        # resets it).
        for e in found:
            if e.kind in ("start", "stop"):
                self._speaking = e.kind == "start"
        for e in found:
            ms = e.sample * 1000 // STT_RATE
            if e.kind == "start":
                self._speech_item = self._ids("item")
                self._send(ev.SpeechStarted(self._speech_item, ms))
                if td.interrupt_response:
                    self._cancel_response("turn_detected")
                # Keep the speech and the padding before it; drop older silence.
                pad = td.prefix_padding_ms * STT_RATE // 1000
                self.buffer.drop_front(e.sample - pad - self.buffer.start_sample)
            elif e.kind == "pause" and self._speech_item is not None:
                self._start_early(self._speech_item)
            elif e.kind == "resume":
                self._drop_early()
            elif e.kind == "stop" and self._speech_item is not None:
                self._send(ev.SpeechStopped(self._speech_item, ms))
                self.turn_ended_at = now
                self._commit(now, self._speech_item, respond=td.create_response)
        if not self._speaking:
            # Between turns only the padding before the next speech start is worth keeping.
            pad = td.prefix_padding_ms * STT_RATE // 1000 + 2 * WINDOW
            self.buffer.drop_front(self.buffer.samples - pad)

    def _commit(
        self, now: float, item_id: str | None = None, *, respond: bool | None = None
    ) -> None:
        if self.buffer.samples < STT_RATE // 10:
            raise ProtocolError(
                "input audio buffer holds less than 100 ms of audio: nothing to commit",
                code="input_audio_buffer_commit_empty",
            )
        if item_id is None:
            self.turn_ended_at = now
        item_id = item_id or self._ids("item")
        early, self._early = self._early, None
        if early is not None and early.item_id != item_id:
            self._do(ev.CancelEarly(early.token))
            self._earlies.pop(early.token, None)
            early = None
        previous = self.history[-1].id if self.history else None
        audio = self.buffer.take()
        if self._vad_on:
            self._do(ev.ResetDetector())
            self._speaking = False
        self._speech_item = None
        self._send(ev.Committed(item_id, previous))
        self._send(ev.UserItem(item_id, previous, None))
        td = self.cfg.turn_detection
        if respond is None:
            # A manual commit answers unless server VAD is on with create_response off.
            respond = td is None or td.create_response
        # The user spoke again: whatever was being answered is stale (unless VAD is told not to
        # interrupt answers; then the new turn waits for the running one).
        if td is None or td.interrupt_response:
            self._cancel_response("turn_detected")
        self._queue(Turn(item_id, audio, respond, early))

    def _start_early(self, item_id: str) -> None:
        self._drop_early()
        token, self._next_token = self._next_token, self._next_token + 1
        self._early = self._earlies[token] = Early(token, item_id)
        self._do(
            ev.StartEarly(
                token, self.buffer.peek(), self.cfg.language, self.cfg.transcription_prompt
            )
        )

    def _drop_early(self) -> None:
        if self._early is not None:
            self._do(ev.CancelEarly(self._early.token))
            self._earlies.pop(self._early.token, None)
            self._early = None

    def _early_done(self, token: int, text: str | None) -> None:
        early = self._earlies.pop(token, None)
        if early is None:
            return  # dropped: nobody waits for it
        early.done, early.text = True, text
        if isinstance(self._job, Turn) and self._job.early is early:
            self._transcribe(self._job)

    # --- jobs: one at a time, in order ---------------------------------------------------------

    def _queue(self, job: Job) -> None:
        # One job may be handed to an idle session at once; MAX_PENDING_JOBS wait behind it.
        if len(self._jobs) >= MAX_PENDING_JOBS + (self._job is None):
            raise ProtocolError(
                f"more than {MAX_PENDING_JOBS} turns are waiting to be answered; this one was "
                "dropped",
                code="server_busy",
            )
        self._jobs.append(job)

    def _pump(self) -> None:
        while self._job is None and self._jobs:
            job = self._jobs.popleft()
            match job:
                case Turn():
                    self._job = job
                    self._transcribe(job)
                case ev.CreateResponse():
                    self._job = job
                    self._respond(job)
                case ev.CreateItem(item):
                    previous = self.history[-1].id if self.history else None
                    self.remember(item)
                    if item.role == "user":
                        self._send(ev.UserItem(item.id, previous, item.text))

    def _transcribe(self, turn: Turn) -> None:
        if turn.early is not None:
            if not turn.early.done:
                return  # EarlyTranscribed goes on
            if turn.early.text is not None:
                self._transcribed(turn.item_id, turn.early.text, None)
                return
        self._do(
            ev.Transcribe(
                turn.item_id, turn.audio, self.cfg.language, self.cfg.transcription_prompt
            )
        )

    def _transcribed(self, item_id: str, text: str | None, error: str | None) -> None:
        turn = self._job
        if not isinstance(turn, Turn) or turn.item_id != item_id:
            return
        if error is not None or text is None:
            self._error("inference_error", f"transcription failed: {error}")
            text = ""
        else:
            self._send(ev.Transcript(item_id, text))
            if text:
                self.remember(ev.Item(item_id, "user", text))
        if text and turn.respond:
            self._respond(ev.CreateResponse())
            return  # the turn's job ends with its answer
        if not self.cfg.multi_turn and self.closing is None:
            self._close(1000, "turn complete")
        self._job = None

    # --- the conversation ----------------------------------------------------------------------

    def remember(self, item: ev.Item) -> None:
        self.history.append(item)
        self._history_chars += len(item.text)
        drop = 0
        if len(self.history) > MAX_HISTORY_ITEMS:
            drop = MAX_HISTORY_ITEMS // 4
        if self._history_chars > MAX_HISTORY_CHARS:
            chars = self._history_chars
            while drop < len(self.history) - 1 and chars > MAX_HISTORY_CHARS * 3 // 4:
                chars -= len(self.history[drop].text)
                drop += 1
        if drop:
            self._history_chars -= sum(len(i.text) for i in self.history[:drop])
            del self.history[:drop]
            self.context_from = max(0, self.context_from - drop)

    def messages(self, instructions: str | None) -> tuple[dict[str, object], ...]:
        """The prompt: the instructions, then the items the model reads (from the cut on)."""
        return prompt(self._system(instructions), self.history[self.context_from :])

    def _system(self, instructions: str | None) -> str:
        return instructions if instructions is not None else self.cfg.instructions

    # --- answers -------------------------------------------------------------------------------

    def _respond(self, job: ev.CreateResponse) -> None:
        cfg = self.cfg
        audio = cfg.output_audio if job.output_audio is None else job.output_audio
        r = ResponseState(self._ids("resp"), self._ids("item"), audio)
        sampling = self._sampling
        if cfg.temperature is not None:
            sampling = attrs.evolve(sampling, temperature=cfg.temperature)
        if cfg.seed is not None:
            sampling = attrs.evolve(sampling, seed=cfg.seed)
        request = GenerationRequest(
            request_id=r.id,
            prompt=ChatPrompt(messages=()),
            sampling=sampling,
            max_tokens=job.max_output_tokens or cfg.max_output_tokens,
            cache_key="",
            # Someone is waiting in silence: the high lane, which also skips the join window.
            priority=0,
        )
        a = Answer(r, job, request, list(self.history), cfg.output_rate)
        self._answer = self._active = a
        self._send(ev.ResponseCreated(a.snapshot()))
        self._do(
            ev.StartResponse(
                r.id,
                audio,
                request,
                self._system(job.instructions),
                tuple(a.items),
                cfg.truncation,
                self.context_from,
            )
        )

    def _live(self, response_id: str) -> Answer | None:
        """The answer in progress, if it is this one (news of a cancelled one is dropped)."""
        a = self._active
        return a if a is not None and a.id == response_id else None

    def _answering(self, event: ev.Input, a: Answer) -> None:
        """News of the answer in progress."""
        match event:
            case ev.ContextFitted(_, cut):
                if cut != self.context_from and a.items == self.history:
                    log.info(
                        "realtime %s: the model now reads items %d.. of %d",
                        self.id,
                        cut,
                        len(a.items),
                    )
                    self.context_from = cut
                chat = ChatPrompt(messages=self.messages(a.job.instructions))
                self._do(ev.Submit(a.id, attrs.evolve(a.request, prompt=chat)))
            case ev.Accepted(_, tokens):
                a.state.input_tokens = tokens
            case ev.Generated(_, text, clock):
                pieces = a.generated(text, clock)
                self._send(ev.TextDelta(a.snapshot(), text), response_id=a.id)
                self._actions += [ev.Speak(a.id, piece) for piece in pieces]
            case ev.Usage(_, tokens):
                a.state.output_tokens = tokens
            case ev.GenerationDone():
                self._actions += [ev.Speak(a.id, piece) for piece in a.flush()]
            case ev.SpeakNext(_, piece, clock):
                wait, deadline = a.pace(piece, clock)
                self._do(ev.Synthesize(a.id, piece, wait, deadline, self.cfg.voice, self.cfg.speed))
            case ev.Synthesized(_, pcm, clock):
                for send in a.synthesized(pcm, clock):
                    self._send(send.event, response_id=a.id, first_of_piece=send.first_of_piece)
            case ev.PieceDone():
                a.state.pieces_pending -= 1
            case ev.Written(_, piece):
                a.unsent.discard(piece)

    def _response_ended(self, ended: ev.ResponseEnded) -> None:
        a = self._answer
        if a is None or a.id != ended.response_id:
            return
        r = a.state
        if self._active is a:
            if ended.outcome == "completed":
                r.status = "completed"
            elif ended.outcome == "failed":
                r.status, r.reason = "failed", ended.error_type
                self._error("inference_error", f"answer failed: {ended.message}")
            else:  # the session ended under it
                r.status, r.reason = "cancelled", "session_closed"
            self._end_response(a)
        if not self.cfg.multi_turn and r.status != "cancelled":
            self._close(1000, "turn complete")
        self._answer = None
        self._job = None

    def _cancel_response(self, reason: str, *, always_report: bool = False) -> None:
        """Stop the running answer now: its unsent audio is dropped and its end is reported
        before anything else the session sends (so a close right after still carries it)."""
        if (a := self._active) is not None:
            a.cancel(reason)
            self._do(ev.Purge(a.id))
            self._end_response(a)
            self._do(ev.CancelGeneration(a.id))
        elif always_report:
            r = ResponseState(self._ids("resp"), self._ids("item"), False, status="cancelled")
            r.reason = reason
            self._send(ev.ResponseDone(r))

    def _end_response(self, a: Answer) -> None:
        """Report a finished answer and keep what the user heard of it (once per answer)."""
        self._active = None
        r = a.state
        if r.heard:
            self.remember(ev.Item(r.item_id, "assistant", r.heard))
        self._send(ev.ResponseDone(a.snapshot()))


__all__ = ["MAX_HISTORY_CHARS", "MAX_HISTORY_ITEMS", "MAX_PENDING_JOBS", "SessionMachine"]
