"""What the HTTP handlers need from the running system, reached through the app.

Nothing here is "the" model: a handler asks ``ServerContext.model`` for the ``Model`` its
request names (the registry, ``Models``, loads it in router mode and leases it to the request).
A model's generation pipeline is seen through ``Pipeline``, a narrow interface: submit, count
tokens, frozen statistics, control messages. Handlers never hold the scheduler or the
tokenizer, so nothing in ``http/`` can read or change an actor's live state (an import
contract in pyproject.toml keeps those modules out of ``http/``).
"""

from __future__ import annotations

import functools
import hashlib
import time
from collections.abc import Sequence
from typing import Any, Protocol

import attrs
from quart import current_app, request

from mlxcel.actors.audio.stt import SpeechToText
from mlxcel.actors.audio.tts import TextToSpeech
from mlxcel.actors.embedder import Embedder
from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.actors.realtime.capacity import SessionCapacity, session_capacity
from mlxcel.actors.session_store import SessionStore
from mlxcel.actors.stream_sessions import StreamSessions
from mlxcel.actors.toolcalls import ToolFormat
from mlxcel.http.audio_wire import OPENAI_STT_MODELS, OPENAI_TTS_MODELS
from mlxcel.runtime import json_input
from mlxcel.runtime.errors import InvalidRequest, NotFound, require_generation
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


class Model(Protocol):
    """One loaded model as a handler sees it (``actors.hosting.Hosted``)."""

    @property
    def name(self) -> str:
        """What responses call it (the ``model`` field)."""
        ...

    @property
    def info(self) -> ModelInfo: ...

    @property
    def pipeline(self) -> Pipeline: ...

    @property
    def tool_format(self) -> ToolFormat | None:
        """The tool-call format in use (None: --tool-format none, tools are refused)."""
        ...

    @property
    def parallel(self) -> int:
        """Its slots: --parallel, or fewer for a model that cannot batch."""
        ...

    @property
    def generation(self) -> bool:
        """False: no chat model (-m <embedder>): every generation is a 501."""
        ...

    @property
    def embedder(self) -> Embedder | None:
        """Router mode: the worker of an embedding model of the list (None: a chat model)."""
        ...

    @property
    def reranker(self) -> Embedder | None:
        """Router mode: the worker of a reranking (cross-encoder) model of the list."""
        ...


class ModelLine(Protocol):
    """One model of the list, loaded or not (``actors.registry.ModelStatus``)."""

    @property
    def name(self) -> str: ...
    @property
    def source(self) -> str: ...
    @property
    def status(self) -> str:
        """loaded, loading, unloading, unloaded or failed."""
        ...

    @property
    def hosted(self) -> Model | None: ...
    @property
    def error(self) -> str | None: ...


class Models(Protocol):
    """The models this server serves (``actors.registry.Registry``)."""

    @property
    def router(self) -> bool:
        """Router mode (--models-dir): several models, loaded and unloaded by name."""
        ...

    @property
    def max_loaded(self) -> int: ...
    @property
    def autoload(self) -> bool: ...
    @property
    def draining(self) -> bool: ...

    async def get(self, requested: str | None) -> Model:
        """The model a request names, loaded (router mode: loading it first, or a 400 when
        models load only on request), and leased to the request until its response ends.
        Unknown: a 404 listing the names. Cancellation ends the wait."""
        ...

    def default(self) -> Model | None:
        """The one model; in router mode the only loaded one, else None."""
        ...

    def loaded(self) -> Sequence[Model]: ...
    def listing(self) -> Sequence[ModelLine]: ...

    async def load(self, name: str) -> None:
        """Start loading a model (router mode); returns at once."""
        ...

    async def unload(self, name: str) -> None:
        """Unload a model once what it runs has finished (router mode)."""
        ...

    def aliases(self, name: str) -> frozenset[str]:
        """The names a request may call the model ``name`` by."""
        ...


@attrs.define
class ServerContext:
    settings: Settings
    models: Models
    metrics: Metrics
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
    # Responses created with `background: true`, keyed by response id; same actor class.
    background: StreamSessions = attrs.field(factory=StreamSessions)
    # --lora adapters and their global scales (/lora-adapters).
    lora: LoraTable = attrs.field(factory=LoraTable)
    # The realtime session cap, worked out at start from the model's decode rows (None: from
    # the settings alone, e.g. a context built without a server).
    realtime: SessionCapacity | None = None

    def realtime_capacity(self) -> SessionCapacity:
        """The realtime session cap and what it is derived from."""
        if self.realtime is not None:
            return self.realtime
        s = self.settings
        return session_capacity(
            s.realtime_max_sessions, parallel=s.parallel, audio_queue_depth=s.audio_queue_depth
        )

    @property
    def ping_interval(self) -> float:
        """Seconds between SSE keepalive comments (inf: none)."""
        s = self.settings
        return s.sse_ping_interval if s.sse_ping_enabled else float("inf")

    async def model(self, requested: object) -> Model:
        """The model a request names: ``requested`` is the ``model`` field, or the whole
        JSON body (its ``model`` field read; a wrong type counts as absent, and the body's
        own parser names it)."""
        if isinstance(requested, dict):
            requested = requested.get("model")
        name = requested if isinstance(requested, str) else None
        try:
            return await self.models.get(name)
        except NotFound:
            # A model the listing shows, but one that serves other routes: say which.
            if name is not None and (serves := self.serves(name)) is not None:
                raise not_this_route(name, serves) from None
            raise

    def serves(self, name: str) -> str | None:
        """What the side or speech model called ``name`` is and does (None: no such one)."""
        if self.stt is not None and name in {self.stt.model_id, *OPENAI_STT_MODELS}:
            return (
                "a speech-to-text model: it transcribes audio (POST /v1/audio/transcriptions "
                "and /v1/audio/translations)"
            )
        if self.tts is not None and name in {self.tts.model_id, *OPENAI_TTS_MODELS}:
            return "a text-to-speech voice: it speaks text (POST /v1/audio/speech)"
        for worker in (self.embedder, self.reranker):
            if worker is not None and worker.info is not None and worker.info.model_id == name:
                return _side_model(worker.info.is_reranker)
        return None

    def fingerprint(self, model: Model) -> str:
        """OpenAI's `system_fingerprint` for answers of ``model``."""
        info = model.info
        invariant = self.settings.batch_invariant
        return _fingerprint(info.description, str(info.path), info.device, invariant)


@functools.cache
def _fingerprint(description: str, path: str, device: str, batch_invariant: bool) -> str:
    """Which configuration produced an answer, for clients that compare seeded answers. It
    changes with what changes the numbers: our and mlx's versions, the model and its
    precision, the BLAS, the device, the native kernels' instruction set (their sums are
    grouped per vector width), int8 activations and --batch-invariant."""
    from importlib.metadata import version

    from mlxcel import __version__, native
    from mlxcel.models.blas import preload_blas

    parts = (
        __version__,
        version("mlx"),
        description,
        path,
        preload_blas().name,
        device,
        native.kernel_isa(),
        native.int8_activations(),
        str(batch_invariant),
    )
    return "fp_" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]


def _side_model(reranker: bool) -> str:
    if reranker:
        return "a reranking model: it ranks documents (POST /v1/rerank)"
    return "an embedding model: it embeds text (POST /v1/embeddings)"


def not_this_route(name: str, serves: str) -> InvalidRequest:
    """The 400 for a request that names a model of the listing that does not generate text
    (``serves``: what it is and does)."""
    return InvalidRequest(
        f"The model '{name}' is {serves}; it does not chat or generate text. Name a chat "
        "model of GET /v1/models for this route.",
        param="model",
    )


def require_chat(model: Model) -> None:
    """A generation route's first check: a router mode embedding or reranking model is a
    400 saying what it does; a server without a chat model, a 501."""
    if not model.generation and (model.embedder or model.reranker) is not None:
        raise not_this_route(model.name, _side_model(model.embedder is None))
    require_generation(model.generation)


def check_tools(model: Model, gen: GenerationRequest) -> None:
    """A 400 for a request that offers tools when tool calls are off (--tool-format none)."""
    if model.tool_format is None and (
        gen.parse_tools or isinstance(gen.constraint, ForcedToolCall)
    ):
        raise InvalidRequest(
            "Tool calls are turned off on this server (--tool-format none), so it cannot "
            "call tools.",
            param="tools",
        )


def server() -> ServerContext:
    ctx: ServerContext = current_app.config["MLXCEL"]
    return ctx


async def read_json() -> Any:
    """The request body as JSON, read by the one strict reader (json_input): every route's
    malformed, too deep or invalid-Unicode body is the same 400."""
    return json_input.loads(await request.get_data())
