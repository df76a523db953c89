"""Which models a server runs, and starting the embedding / reranking workers.

    -m <chat model> [--embedding-model E] [--reranker-model R]   generation plus side models
    -m <embedder>   [--reranker-model R]                         embedding-only
    -m <cross-encoder> [--embedding-model E]                     rerank-only

In the side-model-only modes the chat model runner is never started; admission is
``GenerationDisabled``, so every generation route answers 501 ``not_implemented`` before any
work, and the served ``ModelInfo`` describes the side model.
"""

from __future__ import annotations

import logging
from functools import partial
from typing import Literal

import attrs
import trio

from mlxcel.actors.admission import Admission
from mlxcel.actors.embedder import Embedder, EmbeddingBackend
from mlxcel.actors.model_runner.backend import ModelInfo
from mlxcel.runtime.errors import NO_GENERATION, NotImplementedRoute
from mlxcel.runtime.messages import GenerationRequest
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.slot import OutputSlot

log = logging.getLogger(__name__)


class GenerationDisabled(Admission):
    """Admission for a server without a chat model: every submit is a 501."""

    def submit(self, request: GenerationRequest) -> OutputSlot:
        raise NotImplementedRoute(NO_GENERATION)


@attrs.define
class SideModels:
    generation: bool = True
    embedder: Embedder | None = None
    reranker: Embedder | None = None

    def model_info(self) -> ModelInfo:
        """The served model's facts in side-model-only mode (the first side model)."""
        from mlxcel.models import device

        worker = self.embedder or self.reranker
        assert worker is not None and worker.info is not None
        info = worker.info
        return ModelInfo(
            model_id=info.model_id,
            path=info.path,
            tokenizer=info.tokenizer,
            eos_token_ids=frozenset(),
            context_length=info.max_length,
            chat_template=None,
            description=f"{info.kind} {info.model_id} ({info.dim}-d)",
            # A device name, no computing: the encoders run on mlx's default device too.
            device=device.describe().label,
        )


def _build(
    spec: str, role: Literal["embedding", "rerank"], settings: Settings, model_id: str | None
) -> EmbeddingBackend:
    """Runs on the worker's thread: resolve, load, warm up."""
    from mlxcel.models.embedding import load_embedder, resolve_embedding_model

    resolved = resolve_embedding_model(spec, settings.cache_dir)
    if model_id is not None:
        resolved = attrs.evolve(resolved, model_id=model_id)
    model = load_embedder(
        resolved, role=role, max_length=settings.embedding_max_length, pooling=settings.pooling
    )
    if role == "rerank":
        model.forward(model.encode_pairs("warm up", ["warm up"]))
    else:
        model.forward(model.encode_texts(["warm up"]))
    log.info("loaded %s model %s (%s)", role, model.info.model_id, model.info.kind)
    return model


def side_worker(
    spec: str, role: Literal["embedding", "rerank"], settings: Settings, model_id: str | None
) -> Embedder:
    """An embedding or reranking worker for ``spec`` (start it with ``nursery.start(.run)``:
    ready once loaded and warmed up); ``model_id`` names it in answers."""
    return Embedder(
        partial(_build, spec, role, settings, model_id),
        batch_size=settings.embedding_batch_size,
        queue_depth=settings.embedding_queue_depth,
        timeout=settings.embedding_request_timeout_secs,
    )


def model_kind(spec: str, settings: Settings) -> str:
    """What ``spec`` is: "chat", or an embedder ("encoder", "decoder") or a cross-encoder
    ("classifier"). Blocking (reads the folder): call it in a thread."""
    from mlxcel.models.embedding import detect_kind, resolve_embedding_model

    return detect_kind(resolve_embedding_model(spec, settings.cache_dir).path)


def info_of(worker: Embedder) -> ModelInfo:
    """A side model's facts as a chat model's are described (no generation)."""
    return SideModels(generation=False, embedder=worker).model_info()


def _main_kind(settings: Settings) -> str:
    from mlxcel.models.embedding import detect_kind, resolve_embedding_model

    assert settings.model is not None
    return detect_kind(resolve_embedding_model(settings.model, settings.cache_dir).path)


async def start_side_models(
    nursery: trio.Nursery, settings: Settings, *, detect: bool = True
) -> SideModels:
    """Decide the serving mode from ``-m`` and start the embedder / reranker workers.

    ``detect=False`` (a test that brings its own chat backend) skips looking at ``-m``.
    Each worker is ready (model loaded and warmed up) when this returns.
    """
    kind = "chat"
    if detect and settings.model is not None:
        kind = await trio.to_thread.run_sync(_main_kind, settings)
    side = SideModels(generation=kind in ("chat",))
    embed_spec = settings.model if kind in ("encoder", "decoder") else settings.embedding_model
    rerank_spec = settings.model if kind == "classifier" else settings.reranker_model
    alias = settings.alias if not side.generation else None

    def worker(spec: str, role: Literal["embedding", "rerank"], main: bool) -> Embedder:
        return side_worker(spec, role, settings, alias if main else None)

    if embed_spec is not None:
        side.embedder = worker(embed_spec, "embedding", embed_spec == settings.model)
        await nursery.start(side.embedder.run)
    if rerank_spec is not None:
        side.reranker = worker(rerank_spec, "rerank", rerank_spec == settings.model)
        await nursery.start(side.reranker.run)
    return side
