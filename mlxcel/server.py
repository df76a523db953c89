"""The integration point: wires the actors and the HTTP front into one root nursery.

Start order (each waits for the previous one's ``started``): side models and audio workers,
the model registry (which, with one model, loads it: its pipeline's start order is in
``actors.hosting``), the session store, then HTTP. The listener binds only once the model is
ready; in router mode (``--models-dir``) models load when asked for.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Literal

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from mlxcel.actors.audio.start import start_audio
from mlxcel.actors.hosting import Hosted, host_model
from mlxcel.actors.model_runner.backend import Backend
from mlxcel.actors.realtime.capacity import announce as announce_realtime
from mlxcel.actors.realtime.capacity import session_capacity
from mlxcel.actors.registry import Registry, scan_models_dir
from mlxcel.actors.session_store import open_session_store
from mlxcel.actors.side_models import (
    GenerationDisabled,
    SideModels,
    info_of,
    model_kind,
    side_worker,
    start_side_models,
)
from mlxcel.actors.stream_sessions import StreamSessions
from mlxcel.drain import CLOSE_MARGIN, drain
from mlxcel.http.app import create_app
from mlxcel.http.context import ServerContext
from mlxcel.http.hangup import Hangups
from mlxcel.http.inflight import InFlight
from mlxcel.http.realtime import realtime_statistics
from mlxcel.models import blas
from mlxcel.runtime.lora import LoraTable
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.system import wait_for_stop_signal

log = logging.getLogger(__name__)


def build_lead_backend(settings: Settings) -> Backend:
    """--distributed, rank 0: the local shard, behind a backend that sends every plan to the
    other ranks first."""
    from mlxcel.actors.model_runner.distributed import BroadcastingBackend, init_group

    return BroadcastingBackend(
        build_mlx_backend(settings), init_group(), settings.distributed_timeout
    )


def follow_lead(settings: Settings) -> None:
    """--distributed, ranks > 0: load the local shard, then apply rank 0's plans until it
    stops (no HTTP, no scheduler)."""
    from mlxcel.actors.model_runner.distributed import follow, init_group

    follow(build_mlx_backend(settings), init_group(), settings.distributed_timeout)


def build_mlx_backend(settings: Settings) -> Backend:
    """Runs on the model runner's thread: resolve, load, warm up."""
    from mlxcel.actors.model_runner.distributed import shard_model
    from mlxcel.actors.model_runner.mlx_backend import MlxBackend
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    resolved = resolve_model(settings.model, settings.cache_dir)
    # --distributed keeps mlx-lm's own layers, which its model.shard knows how to split.
    # --batch-invariant takes the native kernels too: with int8 activations at every row
    # count they give a row the same bits in any batch (invariance.prepare checks each layer).
    loaded = load_model(
        resolved,
        keep_quantized=settings.keep_quantized,
        native=not settings.distributed,
        ctx_size=settings.ctx_size,
    )
    if settings.distributed:
        shard_model(loaded.model)
    if loaded.native_layers:
        from mlxcel import native

        log.info(
            "%d quantised layers on mlxcel's native CPU kernels (%s)",
            loaded.native_layers,
            native.kernel_isa(),
        )
    if settings.chat_template is not None:
        # --chat-template[-file]: the tokenizer renders with it, and every format detection
        # (reasoning markers, tool calls, /props) reads it instead of the model's own.
        loaded.tokenizer.chat_template = settings.chat_template
        loaded = attrs.evolve(loaded, chat_template=settings.chat_template)
    draft = None
    if settings.spec_kind == "draft":
        assert settings.model_draft is not None
        draft = load_model(
            resolve_model(settings.model_draft, settings.cache_dir),
            ctx_size=settings.ctx_size,
        )
        log.info("draft model %s (%s) from %s", draft.model_id, draft.dtype, draft.path)
    backend = MlxBackend(loaded, settings, draft)
    log.info("loaded %s from %s on %s", backend.info.description, loaded.path, backend.info.device)
    if settings.warmup:
        try:
            log.info("warmed up in %.2f s", backend.warmup())
        except BaseException:
            backend.close()  # its threads must not outlive a refused start
            raise
    return backend


def _model_sources(settings: Settings) -> dict[str, str]:
    """The models to serve, by name: ``-m`` alone, or router mode's ``--models-dir`` (and
    ``-m``, named by its folder or file)."""
    if settings.models_dir is None:
        return {settings.alias or settings.model or "default": settings.model or ""}
    found = scan_models_dir(settings.models_dir)
    if settings.model:
        path = Path(settings.model)
        found.setdefault(path.stem if path.suffix == ".gguf" else path.name, settings.model)
    return found


async def _host(
    settings: Settings,
    build_backend: Callable[[], Backend] | None,
    metrics: Metrics,
    side: SideModels,
    name: str,
    source: str,
    *,
    task_status: trio.TaskStatus[Hosted],
) -> None:
    """One model's pipeline (``actors.hosting``): -m's, or a router mode model's."""
    if settings.models_dir is not None:
        # Router mode: each model from its own source, called by its own name.
        own = attrs.evolve(settings, model=source, alias=None)
        kind = await trio.to_thread.run_sync(model_kind, source, own)
        if kind == "chat":
            await host_model(
                name, own, partial(build_mlx_backend, own), metrics, task_status=task_status
            )
            return
        # An embedding or reranking model: its worker, behind a pipeline that answers 501
        # to generation (as -m <embedder> does).
        role: Literal["embedding", "rerank"] = "rerank" if kind == "classifier" else "embedding"
        worker = side_worker(source, role, own, name)
        async with trio.open_nursery() as nursery:
            await nursery.start(worker.run)
            await host_model(
                name,
                own,
                None,
                metrics,
                side_info=info_of(worker),
                disabled=GenerationDisabled,
                embedder=worker if role == "embedding" else None,
                reranker=worker if role == "rerank" else None,
                task_status=task_status,
            )
    elif side.generation:
        build = build_backend or partial(
            build_lead_backend if settings.distributed else build_mlx_backend, settings
        )
        await host_model(None, settings, build, metrics, task_status=task_status)
    else:
        await host_model(
            None,
            settings,
            None,
            metrics,
            side_info=side.model_info(),
            disabled=GenerationDisabled,
            task_status=task_status,
        )


def hypercorn_config(settings: Settings) -> Config:
    config = Config()
    if settings.unix_socket:
        config.bind = [f"unix:{settings.unix_socket}"]
        # Created 0600: only this user may talk to the server through the socket.
        config.umask = 0o177
    else:
        config.bind = [f"{settings.host}:{settings.port}"]
    config.keep_alive_timeout = settings.timeout
    config.read_timeout = None
    config.graceful_timeout = 0.5
    config.accesslog = None
    config.errorlog = logging.getLogger("hypercorn.error")
    # Realtime WebSocket messages are capped at 1 MiB (larger: close 1009).
    config.websocket_max_message_size = 1024 * 1024
    return config


async def serve(
    settings: Settings,
    *,
    build_backend: Callable[[], Backend] | None = None,
    stop: trio.Event | None = None,
    webui: bool = True,
    task_status: trio.TaskStatus[tuple[list[str], ServerContext]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the server until SIGINT/SIGTERM (or ``stop`` is set), then shut down gracefully.

    ``started`` reports the bound addresses once the listener accepts connections. ``webui``:
    browsers get the chat page at ``/`` (``--no-webui`` turns it off).
    """
    metrics = Metrics()
    metrics.live.blas_threads = blas.threads

    async with trio.open_nursery() as root:
        # Embedding / rerank workers; with -m <embedder> the chat model runner never starts.
        side = await start_side_models(root, settings, detect=build_backend is None)
        # Speech-to-text / text-to-speech workers: ready at once, models load on first use.
        audio = await start_audio(root, settings, metrics)
        registry = Registry(
            _model_sources(settings),
            partial(_host, settings, build_backend, metrics, side),
            router=settings.models_dir is not None,
            max_loaded=settings.models_max,
            autoload=settings.models_autoload,
            strict_names=settings.strict_model_names,
            load_timeout=settings.timeout,
            drain_timeout=settings.graceful_timeout,
        )
        await root.start(registry.run)
        # --lora adapters belong to the one model (router mode refuses them): its table, or
        # an empty one.
        one = registry.default() if not registry.router else None
        lora = one.lora if one is not None else LoraTable()
        session_store = open_session_store(settings)
        await root.start(session_store.run)
        streams = StreamSessions()
        await root.start(streams.run)
        background = StreamSessions(max_retained=64)
        await root.start(background.run)

        ctx = ServerContext(
            settings=settings,
            models=registry,
            embedder=side.embedder,
            reranker=side.reranker,
            generation=side.generation,
            metrics=metrics,
            session_store=session_store,
            stt=audio.stt,
            tts=audio.tts,
            streams=streams,
            background=background,
            lora=lora,
            # The one model's own rows (fewer than --parallel for one that cannot batch); in
            # router mode every model is hosted with --parallel.
            realtime=session_capacity(
                settings.realtime_max_sessions,
                parallel=one.parallel if one is not None else settings.parallel,
                audio_queue_depth=settings.audio_queue_depth,
            ),
        )
        metrics.live.scheduler = registry.statistics
        metrics.live.queued = lambda: registry.queued
        metrics.live.model_loads = registry.loads
        workers = {"embedding": side.embedder, "rerank": side.reranker}
        metrics.live.side_jobs = lambda: {
            name: (w.queued, w.working) for name, w in workers.items() if w is not None
        }
        speech = {"speech-to-text": audio.stt, "text-to-speech": audio.tts}
        metrics.live.audio_jobs = lambda: {
            name: w.statistics() for name, w in speech.items() if w is not None
        }
        quart = create_app(ctx, webui=webui)
        app = InFlight(Hangups(quart), scope=registry.request_scope)
        metrics.live.in_flight = lambda: app.active
        if audio.stt is not None:  # realtime voice needs speech-to-text
            capacity = ctx.realtime_capacity()
            metrics.live.realtime_sessions = lambda: realtime_statistics(quart, capacity)
            if audio.tts is not None and side.generation:
                announce_realtime(capacity, log)
        http_stop = trio.Event()
        http_done = trio.Event()

        async def run_http(*, task_status: trio.TaskStatus[list[str]]) -> None:
            try:
                await hypercorn_serve(
                    app,
                    hypercorn_config(settings),
                    shutdown_trigger=http_stop.wait,
                    task_status=task_status,
                )
            finally:
                if settings.unix_socket:
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(settings.unix_socket)
                http_done.set()

        binds: list[str] = await root.start(run_http)
        ctx.ready = True
        served = ", ".join(registry.names) if registry.router else registry.loaded()[0].name
        log.info("serving %s on %s", served, ", ".join(binds))
        task_status.started((binds, ctx))

        if stop is None:
            await wait_for_stop_signal()
        else:
            await stop.wait()
        grace = settings.graceful_timeout
        if settings.distributed:
            from mlxcel.actors.model_runner import distributed

            if distributed.lost:  # no generation can step again: end them now
                grace = min(grace, distributed.LOST_GRACE_S)
        await drain(registry, ctx.long_lived, app, grace)
        # Background responses' generations have ended with the drain; each stores its final
        # object before its body ends.
        with trio.move_on_after(CLOSE_MARGIN):
            await background.wait_idle()
        # Hypercorn's own grace period would also wait for idle keep-alive connections, so it
        # only gets a short one: by now every response has been written.
        http_stop.set()
        await http_done.wait()
        log.info("stopped")
        root.cancel_scope.cancel()
