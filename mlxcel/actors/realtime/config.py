"""A realtime session's settings and the per-response bookkeeping both dialects render."""

from __future__ import annotations

import secrets

import attrs

from mlxcel.runtime.truncation import Truncation

# The seed's cap on a session's life (caches grew with every frame there; here it bounds how
# long one client may hold a session place).
MAX_SESSION_SECONDS = 600.0
IDLE_TIMEOUT_SECONDS = 120.0
CONFIGURE_TIMEOUT_SECONDS = 30.0


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(8)}"


class ProtocolError(Exception):
    """A client event the session refuses; becomes an ``error`` event (the session goes on
    unless the caller closes it)."""

    def __init__(self, message: str, *, code: str = "invalid_request", param: str | None = None):
        super().__init__(message)
        self.message = message
        self.code = code
        self.param = param


@attrs.define
class TurnDetection:
    """Server VAD settings (OpenAI's ``server_vad`` names and defaults)."""

    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500
    # Answer automatically when speech stops; stop a running answer when speech starts.
    create_response: bool = True
    interrupt_response: bool = True


@attrs.define
class SessionConfig:
    model: str
    instructions: str = ""
    seed: int | None = None
    temperature: float | None = None
    max_output_tokens: int | None = 256
    max_seconds: float = MAX_SESSION_SECONDS
    idle_timeout: float = IDLE_TIMEOUT_SECONDS
    # False: the seed's one-shot session (closed with 1000 after the committed turn's answer).
    multi_turn: bool = True
    turn_detection: TurnDetection | None = None
    voice: str | None = None
    speed: float = 1.0
    # "audio" answers are spoken (with their text); "text" answers are text only.
    output_audio: bool = True
    input_rate: int = 16_000
    output_rate: int = 22_050
    language: str | None = None
    transcription_prompt: str | None = None
    # Which items the model reads once the conversation outgrows its budget (runtime/truncation.py);
    # None ("disabled"): all of them, and an answer whose prompt is too long fails.
    truncation: Truncation | None = attrs.field(factory=Truncation)


@attrs.define
class SessionPatch:
    """The fields one ``session.update`` sets (parsed from either vocabulary in ``http/``);
    a field left ``UNSET`` keeps the session's value."""

    values: dict[str, object] = attrs.field(factory=dict)

    def set(self, name: str, value: object) -> None:
        if name not in _CONFIG_FIELDS:
            raise AttributeError(name)
        self.values[name] = value

    def apply(self, cfg: SessionConfig) -> None:
        for name, value in self.values.items():
            setattr(cfg, name, value)


_CONFIG_FIELDS = frozenset(f.name for f in attrs.fields(SessionConfig))


@attrs.define
class ResponseState:
    """One assistant answer while it streams, and what the client actually received."""

    id: str
    item_id: str
    output_audio: bool
    text: str = ""  # everything generated
    # The pieces whose audio reached the client (unsent ones are purged on cancel).
    spoken_pieces: list[str] = attrs.field(factory=list)
    status: str = "in_progress"
    # Why a response ended early: "turn_detected" (barge-in), "client_cancelled", or an error.
    reason: str | None = None
    audio_samples: int = 0  # output samples sent, at the output rate
    # ``AudioWorker.now()`` when the first audio went out: the client plays from then on.
    playback_from: float | None = None
    # Pieces handed to text-to-speech whose audio has not all gone out yet.
    pieces_pending: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def spoken(self) -> str:
        return " ".join(self.spoken_pieces)

    def playback_end(self, output_rate: int) -> float | None:
        """When the client will have played all audio sent so far (``AudioWorker.now()``
        clock); None before the first audio."""
        if self.playback_from is None:
            return None
        return self.playback_from + self.audio_samples / output_rate

    @property
    def heard(self) -> str:
        """What goes into the history: the spoken part for audio answers (a cut-off answer is
        truncated to what the user heard), all the text for text answers."""
        return self.spoken if self.output_audio else self.text
