"""What goes in and out of a realtime session's state machine (``machine.py``).

Four groups, all plain attrs data:

- **client messages**: what ``http/realtime_wire.py`` parses a client event into, in either
  vocabulary (the session never sees JSON);
- **inputs**: a client message with the time it arrived, and what the session's tasks report
  back (speech detected, a transcript, generated text, synthesized audio, an answer's end);
- **server events**: what the client is told, which ``http/`` renders in the session's
  vocabulary;
- **actions**: what the machine asks its tasks to do, ``Send`` (a server event) among them.

Times are values in the inputs: ``now`` is Trio's clock (session deadlines), ``clock`` the
speech workers' clock (``AudioWorker.now()``: playback and synthesis deadlines).

This is one session's own protocol with its I/O shell, as h11's events are, so it lives here
and not in ``runtime/messages.py`` (which would then need the session's config and response
types).
"""

from __future__ import annotations

import attrs
import numpy as np

from mlxcel.actors.realtime.config import ResponseState, SessionConfig, SessionPatch, TurnDetection
from mlxcel.actors.realtime.vad import VadEvent
from mlxcel.runtime.messages import GenerationRequest
from mlxcel.runtime.truncation import Truncation


@attrs.frozen
class Item:
    """One conversation item as the model reads it."""

    id: str
    role: str
    text: str


# --- http -> session: client messages --------------------------------------------------------


@attrs.frozen
class UpdateSession:
    patch: SessionPatch = attrs.field(eq=False)


@attrs.frozen
class Ping:
    pass


@attrs.frozen
class CancelSession:
    pass


@attrs.frozen
class CancelResponse:
    pass


@attrs.frozen
class AppendAudio:
    """PCM16 samples; ``sample_rate`` None: the session's input rate."""

    pcm: np.ndarray = attrs.field(eq=False)
    sample_rate: int | None = None


@attrs.frozen
class CommitAudio:
    pass


@attrs.frozen
class ClearAudio:
    pass


@attrs.frozen
class CreateResponse:
    """``response.create``: answer from the conversation as it is."""

    instructions: str | None = None
    output_audio: bool | None = None
    max_output_tokens: int | None = None


@attrs.frozen
class CreateItem:
    item: Item


@attrs.frozen
class Refused:
    """A client event that could not be parsed: an ``error`` event, unless the session's state
    makes another error come first. ``event``: it was a JSON object (``kind``: its string
    ``type``, if any)."""

    message: str
    code: str = "invalid_request"
    param: str | None = None
    event: bool = False
    kind: str | None = None


ClientMessage = (
    UpdateSession
    | Ping
    | CancelSession
    | CancelResponse
    | AppendAudio
    | CommitAudio
    | ClearAudio
    | CreateResponse
    | CreateItem
    | Refused
)


# --- tasks -> machine: inputs ----------------------------------------------------------------


@attrs.frozen
class Received:
    message: ClientMessage
    now: float


@attrs.frozen
class TimedOut:
    """No client event before ``SessionMachine.deadline``."""

    now: float


@attrs.frozen
class SpeechDetected:
    """What VAD found in the audio of the last ``DetectSpeech``."""

    events: tuple[VadEvent, ...]
    now: float


@attrs.frozen
class DetectionFailed:
    """VAD failed on the audio of the last ``DetectSpeech`` (that audio went unexamined)."""

    message: str


@attrs.frozen
class EarlyTranscribed:
    """An early transcription ended; ``text`` None: cancelled or failed."""

    token: int
    text: str | None


@attrs.frozen
class Transcribed:
    item_id: str
    text: str | None
    error: str | None = None


@attrs.frozen
class ContextFitted:
    """Where the conversation's cut goes for this answer (``fit_context``)."""

    response_id: str
    cut: int


@attrs.frozen
class Accepted:
    response_id: str
    input_tokens: int


@attrs.frozen
class Generated:
    response_id: str
    text: str
    clock: float


@attrs.frozen
class Usage:
    response_id: str
    output_tokens: int


@attrs.frozen
class GenerationDone:
    response_id: str


@attrs.frozen
class SpeakNext:
    """The speaker is ready for its next piece."""

    response_id: str
    piece: str
    clock: float


@attrs.frozen
class Synthesized:
    """PCM16 of the piece being spoken, at the session's output rate."""

    response_id: str
    pcm: np.ndarray = attrs.field(eq=False)
    clock: float = 0.0


@attrs.frozen
class PieceDone:
    response_id: str


@attrs.frozen
class ResponseEnded:
    """An answer's task returned: ``outcome`` is completed, failed or cancelled."""

    response_id: str
    outcome: str
    error_type: str | None = None
    message: str = ""


@attrs.frozen
class Written:
    """The writer took the first audio of ``piece`` off the outbox (it can no longer be purged)."""

    response_id: str
    piece: int


@attrs.frozen
class ShutDown:
    pass


Input = (
    Received
    | TimedOut
    | SpeechDetected
    | DetectionFailed
    | EarlyTranscribed
    | Transcribed
    | ContextFitted
    | Accepted
    | Generated
    | Usage
    | GenerationDone
    | SpeakNext
    | Synthesized
    | PieceDone
    | ResponseEnded
    | Written
    | ShutDown
)


# --- machine -> http: server events (rendered per vocabulary) --------------------------------
# A ``ResponseState`` in an event is a copy taken when the event was made.


@attrs.frozen
class SessionCreated:
    session_id: str
    config: SessionConfig


@attrs.frozen
class SessionUpdated:
    session_id: str
    config: SessionConfig


@attrs.frozen
class SpeechStarted:
    item_id: str
    ms: int


@attrs.frozen
class SpeechStopped:
    item_id: str
    ms: int


@attrs.frozen
class Cleared:
    pass


@attrs.frozen
class Pong:
    pass


@attrs.frozen
class Committed:
    item_id: str
    previous: str | None


@attrs.frozen
class UserItem:
    """A user message entered the conversation (``text`` None: audio, transcript to come)."""

    item_id: str
    previous: str | None
    text: str | None


@attrs.frozen
class Transcript:
    item_id: str
    text: str


@attrs.frozen
class ResponseCreated:
    response: ResponseState


@attrs.frozen
class TextDelta:
    response: ResponseState
    delta: str


@attrs.frozen
class AudioDelta:
    response: ResponseState
    pcm: bytes = attrs.field(repr=False)


@attrs.frozen
class Spoken:
    """The first audio of ``piece`` is going out."""

    response: ResponseState
    piece: str


@attrs.frozen
class ResponseDone:
    response: ResponseState


@attrs.frozen
class Error:
    code: str
    message: str
    param: str | None = None


ServerEvent = (
    SessionCreated
    | SessionUpdated
    | SpeechStarted
    | SpeechStopped
    | Cleared
    | Pong
    | Committed
    | UserItem
    | Transcript
    | ResponseCreated
    | TextDelta
    | AudioDelta
    | Spoken
    | ResponseDone
    | Error
)


# --- machine -> tasks: actions ---------------------------------------------------------------


@attrs.frozen
class Send:
    """Queue ``event`` for the client. ``samples_in``: input audio received so far (VoiceChat
    stamps ``frame_index`` from it); ``response_id``: purgeable with that answer;
    ``first_of_piece``: this is the first audio of that spoken piece."""

    event: ServerEvent
    samples_in: int = 0
    response_id: str | None = None
    first_of_piece: int | None = None


@attrs.frozen
class Close:
    """Send what is queued, then close the WebSocket."""

    code: int
    reason: str


@attrs.frozen
class Purge:
    """Drop the answer's events still queued for the client (the user never heard them)."""

    response_id: str


@attrs.frozen
class SetDetector:
    """Start a fresh VAD stream at session sample ``start`` (``settings`` None: no VAD)."""

    settings: TurnDetection | None
    start: int


@attrs.frozen
class ResetDetector:
    """Forget the speech in progress (the stream keeps its clock)."""


@attrs.frozen
class DetectSpeech:
    """Run VAD over this 16 kHz PCM16 and report ``SpeechDetected`` before the next message."""

    pcm: np.ndarray = attrs.field(eq=False)


@attrs.frozen
class StartEarly:
    """Transcribe ``audio`` now (the turn has probably ended); report ``EarlyTranscribed``."""

    token: int
    audio: np.ndarray = attrs.field(eq=False)
    language: str | None = None
    prompt: str | None = None


@attrs.frozen
class CancelEarly:
    token: int


@attrs.frozen
class Transcribe:
    """Transcribe a committed turn; report ``Transcribed``."""

    item_id: str
    audio: np.ndarray = attrs.field(eq=False)
    language: str | None = None
    prompt: str | None = None


@attrs.frozen
class StartResponse:
    """Run an answer: fit the context (``fit_context`` over these), report ``ContextFitted``,
    submit what ``Submit`` says, report its progress, speak if ``output_audio``; report
    ``ResponseEnded`` however it ends."""

    response_id: str
    output_audio: bool
    request: GenerationRequest
    system: str
    items: tuple[Item, ...]
    truncation: Truncation | None
    context_from: int


@attrs.frozen
class Submit:
    response_id: str
    request: GenerationRequest


@attrs.frozen
class Speak:
    """Hand ``piece`` to the answer's speaker (waits while 64 pieces are waiting)."""

    response_id: str
    piece: str


@attrs.frozen
class Synthesize:
    """Speak ``piece`` after ``wait`` seconds, for the speech worker's ``deadline``."""

    response_id: str
    piece: str
    wait: float
    deadline: float | None
    voice: str | None
    speed: float


@attrs.frozen
class CancelGeneration:
    """Stop the answer's task now (its generation is aborted like a disconnect)."""

    response_id: str


Action = (
    Send
    | Close
    | Purge
    | SetDetector
    | ResetDetector
    | DetectSpeech
    | StartEarly
    | CancelEarly
    | Transcribe
    | StartResponse
    | Submit
    | Speak
    | Synthesize
    | CancelGeneration
)
