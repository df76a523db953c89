"""The realtime-voice actor: one per WebSocket session, a cascaded speech-to-speech pipeline.

    client --typed messages--> reader --Received--> SessionMachine --actions--> tasks
                                 | DetectSpeech (VAD, thread)             | early / turn STT
                                 |                                        | answer: LLM via
                                 |                                        |   admission, then
                                 |                                        |   speaker -> TTS
    client <--------------- writer <== outbox <== Send (rendered by http/) +

Every decision is the state machine's (``actors/realtime/machine.py``: pure, no Trio, no
clock); this module holds the thin tasks that carry its actions out and report back: the
reader (waits for a client message or the machine's deadline), the writer, VAD in a thread,
transcriptions, and one task per answer (fit the context, generate, speak). An answer runs in
its own CancelScope, so barge-in (VAD speech start while answering), ``response.cancel`` and a
new commit stop it at once: its generation is aborted like a disconnected HTTP request, its
unsent audio is purged from the outbox, and the assistant turn kept in the history is cut to
the pieces whose audio reached the client.

The transport (``http/realtime_wire.py``) parses client events into typed messages and renders
typed server events in the session's vocabulary, so no JSON is read here.

Bounds: the input buffer holds at most ``max_buffer_seconds`` of uncommitted audio (an append
beyond it is refused with an error), and input audio is read at most ``INPUT_SPEED`` times real
time after a burst of that much; at most ``MAX_PENDING_JOBS`` turns wait to be answered;
the outbox holds at most ``max_outbox_bytes`` (a client that falls that far behind is closed
with 1008 rather than slowing anyone else), and a send the client does not take within
``send_timeout`` seconds hangs the connection up (a client that reads nothing cannot even be
sent a close frame). A turn that finds the speech workers busy waits in line for them
(``wait=True``: bounded by --audio-request-timeout-secs, see ``actors/audio/worker.py``) rather
than being refused, and any failure in a turn (a worker's error, or an unexpected exception in
speech detection, transcription, generation or speech) is an ``error`` event: the session goes
on. Cancellation of ``run`` (the client went away, the server stops) aborts the running answer,
leaves any line it waits in, and returns.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Iterator
from typing import Any, Protocol, TypeVar, cast

import attrs
import numpy as np
import trio

from mlxcel.actors.audio.worker import AudioWorker
from mlxcel.actors.realtime import events as ev
from mlxcel.actors.realtime.answer import fit_context
from mlxcel.actors.realtime.audio import InputPace, Resampler
from mlxcel.actors.realtime.config import SessionConfig, new_id
from mlxcel.actors.realtime.machine import SessionMachine
from mlxcel.actors.realtime.outbox import Outbox
from mlxcel.actors.realtime.vad import SileroModel, VadStream
from mlxcel.runtime.errors import InternalError, MlxcelError
from mlxcel.runtime.messages import GenerationRequest, SamplingParams
from mlxcel.runtime.slot import OutputSlot

log = logging.getLogger(__name__)

A = TypeVar("A", bound=ev.Action)

# Input audio is read at most this many times real time, after a burst of a full input buffer
# (``InputPace``): well above a microphone's 1x or a 10x replay, well below a flood.
INPUT_SPEED = 20.0


class Transport(Protocol):
    """The session's WebSocket in its vocabulary (``http/realtime_wire.RealtimeWire``)."""

    name: str
    needs_configure: bool

    def initial_config(self, model: str) -> SessionConfig: ...
    async def receive(self) -> ev.ClientMessage: ...
    def render(self, event: ev.ServerEvent, samples_in: int) -> list[dict[str, Any]]: ...
    async def send(self, data: str) -> None: ...
    async def close(self, code: int, reason: str) -> None: ...

    def hang_up(self) -> bool:
        """Drop the connection now, without a close frame (the writer blocked in ``send``
        then returns). False where the server offers no way to."""
        ...


class SpeechToText(Protocol):
    async def transcribe(
        self,
        audio: np.ndarray,
        *,
        language: str | None = ...,
        prompt: str | None = ...,
        greedy: bool = ...,
        wait: bool = ...,
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
        wait: bool = ...,
    ) -> AsyncIterator[bytes]: ...


class Generation(Protocol):
    """Where a session's answers are generated: the pipeline's submit, as HTTP has it."""

    def submit(self, request: GenerationRequest) -> OutputSlot: ...


@attrs.frozen
class VoiceDeps:
    """What a session needs from the running server."""

    generation: Generation
    stt: SpeechToText
    tts: TextToSpeech
    sampling: SamplingParams
    model_id: str
    vad_model: Callable[[], SileroModel]
    # A shared limiter for VAD work in threads (so many sessions cannot flood the pool).
    vad_limiter: trio.CapacityLimiter
    max_buffer_seconds: float = 120.0
    max_outbox_bytes: int = 8 * 1024 * 1024
    # Seconds one send (or the close) may wait for the client to take it before the
    # connection is hung up (--realtime-send-timeout-secs).
    send_timeout: float = 10.0
    # Prompt tokens of a request, rendered and encoded as generation will (blocking: called
    # in a thread), and the context window; without them no truncation happens.
    count_tokens: Callable[[GenerationRequest], int] | None = None
    context_length: int = 0


class RealtimeSession:
    def __init__(self, transport: Transport, deps: VoiceDeps) -> None:
        self.id = new_id("sess")
        self._t = transport
        self._deps = deps
        self.machine = SessionMachine(
            session_id=self.id,
            config=transport.initial_config(deps.model_id),
            needs_configure=transport.needs_configure,
            sampling=deps.sampling,
            now=trio.current_time(),
            max_buffer_seconds=deps.max_buffer_seconds,
            voice_error=self._voice_error,
        )
        self._out = Outbox(deps.max_outbox_bytes)
        self._pace = InputPace(INPUT_SPEED, deps.max_buffer_seconds, trio.current_time())
        self._vad: VadStream | None = None
        self._nursery: trio.Nursery | None = None
        # Cancel scopes of early transcriptions (by token) and of answers (by response id).
        self._early: dict[int, trio.CancelScope] = {}
        self._answers: dict[str, trio.CancelScope] = {}
        # When the send under way must be done by (inf: none is): the stall guard's clock.
        self._send_deadline = math.inf
        # Why the server ended the session for its client's sake: "outgoing_backlog" (the
        # outbox overflowed) or "send_timeout" (a send stalled); None otherwise.
        self.dropped: str | None = None

    @property
    def input_bytes(self) -> int:
        """Uncommitted input audio held (float32 samples)."""
        return self.machine.buffer.samples * 4

    @property
    def output_bytes(self) -> int:
        """Outgoing events queued, not yet handed to the socket."""
        return self._out.pending_bytes

    # --- lifecycle ---------------------------------------------------------------------------

    async def run(self) -> None:
        """Serve the session until it closes (client, timeout, cap) or is cancelled.

        Cancellation aborts the running answer (its generation is aborted at the next step)
        and returns without closing the WebSocket (the caller owns it); a send stuck on a
        client that reads nothing is hung up first, after at most ``send_timeout``.
        """
        self._apply(self.machine.start())
        done = trio.Event()
        async with trio.open_nursery() as guarded:
            guarded.start_soon(self._stall_guard, done)
            try:
                async with trio.open_nursery() as n:
                    self._nursery = n
                    n.start_soon(self._writer)
                    n.start_soon(self._reader)
            finally:
                done.set()
        if self._out.overflowed:
            self.dropped = self.dropped or "outgoing_backlog"
            log.warning("realtime %s: client too slow, outgoing queue overflowed", self.id)

    def shut_down(self) -> None:
        """The server is stopping: end the running answer, say why, then close 1001 (going
        away). Sync and idempotent; called from outside the session's nursery."""
        self._apply(self.machine.feed(ev.ShutDown()))

    def _voice_error(self, voice: str | None) -> str | None:
        try:
            self._deps.tts.voice_for(voice)
        except MlxcelError as error:
            return error.message
        return None

    # --- carrying out the machine's actions --------------------------------------------------

    def _feed(self, event: ev.Input) -> list[ev.Action]:
        """Feed the machine; do what it says at once; return what only the caller can do
        (``DetectSpeech``, ``Submit``, ``Speak``, ``Synthesize``)."""
        return self._apply(self.machine.feed(event))

    def _apply(self, actions: list[ev.Action]) -> list[ev.Action]:
        rest: list[ev.Action] = []
        for action in actions:
            match action:
                case ev.Send(event, samples_in, response_id, first_of_piece):
                    for payload in self._t.render(event, samples_in):
                        self._out.put(
                            payload, response_id=response_id, first_of_piece=first_of_piece
                        )
                    if isinstance(event, ev.Spoken):
                        self._log_first_audio(event)
                case ev.Close(code, reason):
                    self._out.close(code, reason)
                case ev.Purge(response_id):
                    self._out.purge(response_id)
                case ev.SetDetector(td, start):
                    self._vad = (
                        None
                        if td is None
                        else VadStream(
                            self._deps.vad_model(),
                            threshold=td.threshold,
                            silence_ms=td.silence_duration_ms,
                            start=start,
                        )
                    )
                case ev.ResetDetector():
                    if self._vad is not None:
                        self._vad.reset()
                case ev.StartEarly():
                    early = self._early[action.token] = trio.CancelScope()
                    self._start(self._transcribe_early, action, early)
                case ev.CancelEarly(token):
                    if token in self._early:
                        self._early.pop(token).cancel()
                case ev.Transcribe():
                    self._start(self._transcribe, action)
                case ev.StartResponse():
                    answer = self._answers[action.response_id] = trio.CancelScope()
                    self._start(self._respond, action, answer)
                case ev.CancelGeneration(response_id):
                    if response_id in self._answers:
                        self._answers[response_id].cancel()
                case ev.DetectSpeech() | ev.Submit() | ev.Speak() | ev.Synthesize():
                    rest.append(action)
        return rest

    def _start(self, task: Callable[..., Any], *args: object) -> None:
        assert self._nursery is not None
        self._nursery.start_soon(task, *args)

    def _log_first_audio(self, event: ev.Spoken) -> None:
        ended = self.machine.turn_ended_at
        if len(event.response.spoken_pieces) == 1 and ended is not None:
            log.debug(
                "realtime %s: first audio %.2f s after the end of speech",
                self.id,
                trio.current_time() - ended,
            )

    # --- reader and writer -------------------------------------------------------------------

    async def _reader(self) -> None:
        while self.machine.closing is None:
            message: ev.ClientMessage | None = None
            with trio.move_on_at(self.machine.deadline):
                message = await self._t.receive()
            if message is None:
                self._feed(ev.TimedOut(trio.current_time()))
                continue
            for action in self._feed(ev.Received(message, trio.current_time())):
                assert isinstance(action, ev.DetectSpeech)
                await self._detect(action.pcm)
            if isinstance(message, ev.AppendAudio):
                rate = message.sample_rate or self.machine.cfg.input_rate
                await trio.sleep(self._pace.take(message.pcm.size / rate, trio.current_time()))

    async def _detect(self, pcm: np.ndarray) -> None:
        vad = self._vad
        assert vad is not None
        audio = pcm.astype(np.float32) / 32768.0
        try:
            found = await trio.to_thread.run_sync(vad.feed, audio, limiter=self._deps.vad_limiter)
        except Exception as error:  # noqa: BLE001 - this audio goes unheard; the session lives
            self._feed(ev.DetectionFailed(_fault(self.id, "speech detection", error).message))
            return
        self._feed(ev.SpeechDetected(tuple(found), trio.current_time()))

    async def _writer(self) -> None:
        while True:
            item = await self._out.get()
            if isinstance(item, tuple):
                code, reason = item
                with self._sending(), trio.move_on_after(5):
                    await self._t.close(code, reason)
                assert self._nursery is not None
                self._nursery.cancel_scope.cancel()
                return
            if item.first_of_piece is not None and item.response_id is not None:
                self._feed(ev.Written(item.response_id, item.first_of_piece))
            with self._sending():
                await self._t.send(item.text)

    @contextlib.contextmanager
    def _sending(self) -> Iterator[None]:
        self._send_deadline = trio.current_time() + self._deps.send_timeout
        try:
            yield
        finally:
            self._send_deadline = math.inf

    async def _stall_guard(self, done: trio.Event) -> None:
        """Hang up on a client that takes no send within ``send_timeout``; return once the
        session's tasks are done.

        Shielded: the server's WebSocket send cannot be cancelled while the client's window is
        full (Hypercorn writes in a shielded scope), so a session cancelled by the client's
        departure or the server's shutdown may still be waiting in it, and only the hang-up
        ends that wait.
        """
        with trio.CancelScope(shield=True):
            while not done.is_set():
                now = trio.current_time()
                if now >= self._send_deadline:
                    self._hang_up()
                    return
                # A send that starts meanwhile is due within send_timeout of now.
                with trio.move_on_at(min(self._send_deadline, now + self._deps.send_timeout)):
                    await done.wait()

    def _hang_up(self) -> None:
        self.dropped = "send_timeout"
        timeout = self._deps.send_timeout
        if self._t.hang_up():
            log.warning(
                "realtime %s: client took no data for %g s, connection dropped", self.id, timeout
            )
        else:
            log.warning(
                "realtime %s: client took no data for %g s; the server cannot drop the "
                "connection, the session ends when the client goes",
                self.id,
                timeout,
            )
        self._out.close(1008, "client too slow: send timed out")
        if self._nursery is not None:
            self._nursery.cancel_scope.cancel()

    # --- speech to text ----------------------------------------------------------------------

    async def _transcribe_early(self, start: ev.StartEarly, scope: trio.CancelScope) -> None:
        text = None
        try:
            with scope:
                result = await self._stt(start.audio, start.language, start.prompt)
                text = str(result.text).strip()
        except MlxcelError:
            pass  # the turn, if it ends, transcribes itself and reports the error
        except Exception as error:  # noqa: BLE001 - as above, once logged
            _fault(self.id, "early transcription", error)
        finally:
            self._early.pop(start.token, None)
            self._feed(ev.EarlyTranscribed(start.token, text))

    async def _transcribe(self, job: ev.Transcribe) -> None:
        try:
            result = await self._stt(job.audio, job.language, job.prompt)
            text = str(result.text).strip()
        except MlxcelError as error:
            self._feed(ev.Transcribed(job.item_id, None, error.message))
            return
        except Exception as error:  # noqa: BLE001 - fails this turn only (an error event)
            self._feed(
                ev.Transcribed(job.item_id, None, _fault(self.id, "transcription", error).message)
            )
            return
        self._feed(ev.Transcribed(job.item_id, text))

    async def _stt(self, audio: np.ndarray, language: str | None, prompt: str | None) -> Any:
        return await self._deps.stt.transcribe(
            audio,
            language=language,
            prompt=prompt,
            greedy=True,  # a live turn waits on this: no beam search, a short window
            wait=True,  # a busy worker is waited for: the user does not say it again
        )

    # --- answers -----------------------------------------------------------------------------

    async def _respond(self, start: ev.StartResponse, scope: trio.CancelScope) -> None:
        """One answer, reported as it goes. Cancelled (barge-in, the session ends): its
        generation is aborted and its speech stops; the machine hears ``ResponseEnded``.
        A server error (generation's or the voice's, raised alone or from the answer's
        nursery), or any unexpected exception, fails this answer only: the session reports it
        and goes on."""
        rid = start.response_id
        outcome = ev.ResponseEnded(rid, "cancelled")
        try:
            with scope:
                try:
                    await self._generate(start)
                    outcome = ev.ResponseEnded(rid, "completed")
                except* MlxcelError as failed:
                    error = _first(failed)
                    log.warning("realtime %s: answer %s failed: %s", self.id, rid, error.message)
                    outcome = ev.ResponseEnded(rid, "failed", error.error_type, error.message)
                except* Exception as failed:
                    error = _fault(self.id, f"answer {rid}", failed)
                    outcome = ev.ResponseEnded(rid, "failed", error.error_type, error.message)
        finally:
            del self._answers[rid]
            self._feed(outcome)

    async def _generate(self, start: ev.StartResponse) -> None:
        rid = start.response_id
        deps = self._deps
        cut = await trio.to_thread.run_sync(
            fit_context, deps.count_tokens, deps.context_length, start
        )
        submit = _only(self._feed(ev.ContextFitted(rid, cut)), ev.Submit)
        if submit is None:
            return  # no longer wanted
        slot = deps.generation.submit(submit.request)
        async with trio.open_nursery() as n:
            pieces_tx, pieces_rx = trio.open_memory_channel[str](64)
            if start.output_audio:
                n.start_soon(self._speak, start, pieces_rx)
            async with pieces_tx:
                try:
                    self._feed(ev.Accepted(rid, await slot.wait_accepted()))
                    while True:
                        update = await slot.next()
                        assert update is not None
                        if update.text:
                            said = ev.Generated(rid, update.text, AudioWorker.now())
                            for action in self._feed(said):
                                assert isinstance(action, ev.Speak)
                                await pieces_tx.send(action.piece)
                        if update.finish_reason is not None:
                            break
                finally:
                    self._feed(ev.Usage(rid, slot.completion_tokens))
                    slot.cancel()
                for action in self._feed(ev.GenerationDone(rid)):
                    assert isinstance(action, ev.Speak)
                    await pieces_tx.send(action.piece)

    async def _speak(self, start: ev.StartResponse, pieces: trio.MemoryReceiveChannel[str]) -> None:
        rid = start.response_id
        tts = self._deps.tts
        out_rate = self.machine.cfg.output_rate
        resampler = Resampler(tts.sample_rate, out_rate) if tts.sample_rate != out_rate else None
        async for piece in pieces:
            # Ask again after a pacing wait: the voice is the session's when speech starts.
            while True:
                say = _only(self._feed(ev.SpeakNext(rid, piece, AudioWorker.now())), ev.Synthesize)
                if say is None:
                    return  # no longer wanted
                if say.wait <= 0:
                    break
                await trio.sleep(say.wait)
            # A busy voice is waited for (in line, bounded), never a refusal mid-answer.
            speech = tts.synthesize(
                piece, voice=say.voice, speed=say.speed, deadline=say.deadline, wait=True
            )
            # An async generator: closed promptly when the answer is cancelled mid-sentence.
            async with contextlib.aclosing(cast(AsyncGenerator[bytes, None], speech)):
                async for chunk in speech:
                    pcm = np.frombuffer(chunk, dtype="<i2")
                    if resampler is not None:
                        pcm = resampler.push(pcm)
                    self._feed(ev.Synthesized(rid, pcm, AudioWorker.now()))
            self._feed(ev.PieceDone(rid))


def _fault(session: str, what: str, error: BaseException) -> MlxcelError:
    """An unexpected exception in a turn, logged with its traceback, as the error the client
    is told of (its type only: the message may hold anything)."""
    log.error("realtime %s: %s failed unexpectedly", session, what, exc_info=error)
    leaf: BaseException = error
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return InternalError(f"internal error ({type(leaf).__name__})")


def _first(group: BaseExceptionGroup[MlxcelError]) -> MlxcelError:
    """The first error of a group (nurseries nest them)."""
    error: BaseException = group
    while isinstance(error, BaseExceptionGroup):
        error = error.exceptions[0]
    assert isinstance(error, MlxcelError)
    return error


def _only(actions: list[ev.Action], kind: type[A]) -> A | None:
    """The one action a task waits for (none when the machine no longer wants the answer)."""
    for action in actions:
        assert isinstance(action, kind)
        return action
    return None


__all__ = ["RealtimeSession", "Transport", "VoiceDeps"]
