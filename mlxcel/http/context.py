"""What the HTTP handlers need from the running system, reached through the app.

Handlers see the generation pipeline through ``Pipeline``, a narrow interface: submit, count
tokens, frozen statistics, control messages. They never hold the scheduler or the tokenizer,
so nothing in ``http/`` can read or change an actor's live state (an import contract in
pyproject.toml keeps those modules out of ``http/``).
"""

from __future__ import annotations

import functools
import hashlib
import time
from typing import Any, Protocol

import attrs
from quart import current_app, request

from mlxcel.actors.audio.stt import SpeechToText
from mlxcel.actors.audio.tts import TextToSpeech
from mlxcel.actors.embedder import Embedder
from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.session_store import SessionStore
from mlxcel.actors.stream_sessions import StreamSessions
from mlxcel.actors.toolcalls import ToolFormat
from mlxcel.runtime import json_input
from mlxcel.runtime.errors import InvalidRequest, NotFound
from mlxcel.runtime.lora import LoraTable
from mlxcel.runtime.messages import (
    ForcedToolCall,
    GenerationRequest,
    SchedulerControl,
    SchedulerStatistics,
)
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.slot import OutputSlot
from mlxcel.runtime.system import LongLived


class Pipeline(Protocol):
    """What a handler may ask of the generation pipeline (``actors/pipeline.py``)."""

    @property
    def draining(self) -> bool:
        """Shutting down: new work is refused (503)."""
        ...

    @property
    def reasons(self) -> bool:
        """The chat template has thinking blocks."""
        ...

    def submit(self, request: GenerationRequest) -> OutputSlot:
        """Admit a generation (a 503 when the queue is full, before any byte is sent); its
        output arrives in the slot, and cancelling the slot aborts it."""
        ...

    def count_tokens(self, request: GenerationRequest) -> int:
        """Prompt tokens, rendered and encoded exactly as generation will (blocking: call it
        in a thread; thread-safe)."""
        ...

    def render(self, request: GenerationRequest) -> str:
        """The exact text the model would read (the chat template applied)."""
        ...

    def statistics(self) -> SchedulerStatistics:
        """A frozen copy of the scheduler's state, taken now."""
        ...

    async def control(self, message: SchedulerControl) -> None:
        """Send the scheduler a control message (applied at the next step boundary)."""
        ...


@attrs.define
class ServerContext:
    settings: Settings
    info: ModelInfo
    pipeline: Pipeline
    metrics: Metrics
    # The tool-call format in use (None: --tool-format none, tools are refused).
    tool_format: ToolFormat | None = None
    created: int = attrs.field(factory=lambda: int(time.time()))
    ready: bool = False
    # Realtime WebSockets, closed by the drain with a reason (``runtime.system``).
    long_lived: LongLived = attrs.field(factory=LongLived)
    # Side models on their own worker threads (None when not loaded). With generation False
    # (-m <embedder> or <cross-encoder>) no chat model runs: admission answers 501.
    embedder: Embedder | None = None
    reranker: Embedder | None = None
    generation: bool = True
    # Stored Responses and conversations, and the responses being generated now.
    session_store: SessionStore | None = None
    # Audio workers (None when not loaded: --no-audio, --stt-model none, nothing installed).
    stt: SpeechToText | None = None
    tts: TextToSpeech | None = None
    # Resumable streams (X-Conversation-Id), run by their own actor.
    streams: StreamSessions = attrs.field(factory=StreamSessions)
    # --lora adapters and their global scales (/lora-adapters).
    lora: LoraTable = attrs.field(factory=LoraTable)

    @property
    def ping_interval(self) -> float:
        """Seconds between SSE keepalive comments (inf: none)."""
        s = self.settings
        return s.sse_ping_interval if s.sse_ping_enabled else float("inf")

    @property
    def model_id(self) -> str:
        return self.info.model_id

    @functools.cached_property
    def fingerprint(self) -> str:
        """OpenAI's `system_fingerprint`: which configuration produced an answer, for clients
        that compare seeded answers. It changes with what changes the numbers: our and mlx's
        versions, the model and its precision, the BLAS, the device and --batch-invariant."""
        from importlib.metadata import version

        from mlxcel import __version__
        from mlxcel.models.blas import preload_blas

        parts = (
            __version__,
            version("mlx"),
            self.info.description,
            str(self.info.path),
            preload_blas().name,
            self.info.device,
            str(self.settings.batch_invariant),
        )
        return "fp_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]

    def check_model(self, requested: str | None) -> str:
        """The served id for a request's `model` field. Any name is served (llama-server's
        single-model mode); with --strict-model-names an unknown one is a 404."""
        if requested is None or not self.settings.strict_model_names:
            return self.model_id
        if requested in self.accepted_names:
            return self.model_id
        raise NotFound(
            f"The model '{requested}' does not exist. This server serves '{self.model_id}' "
            f"(also reachable as 'default').",
            param="model",
        )

    def check_tools(self, gen: GenerationRequest) -> None:
        """A 400 for a request that offers tools when tool calls are off (--tool-format none)."""
        if self.tool_format is None and (
            gen.parse_tools or isinstance(gen.constraint, ForcedToolCall)
        ):
            raise InvalidRequest(
                "Tool calls are turned off on this server (--tool-format none), so it cannot "
                "call tools.",
                param="tools",
            )

    @property
    def accepted_names(self) -> frozenset[str]:
        names = {self.model_id, "default"}
        if self.info.path is not None:
            names.add(self.info.path.name)
        return frozenset(names)


def server() -> ServerContext:
    ctx: ServerContext = current_app.config["MLXCEL"]
    return ctx


async def read_json() -> Any:
    """The request body as JSON, read by the one strict reader (json_input): every route's
    malformed, too deep or invalid-Unicode body is the same 400."""
    return json_input.loads(await request.get_data())
