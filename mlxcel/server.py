"""The integration point: wires the actors and the HTTP front into one root nursery.

Start order (each waits for the previous one's ``started``): model runner (loads and warms up
the model on its own thread) -> streamer -> scheduler -> tokenizer -> admission -> HTTP. The
listener binds only once the model is ready.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from functools import partial

import attrs
import trio
from hypercorn.config import Config
from hypercorn.trio import serve as hypercorn_serve

from mlxcel.actors.admission import Admission
from mlxcel.actors.audio.start import start_audio
from mlxcel.actors.model_runner.backend import Backend, ModelInfo
from mlxcel.actors.model_runner.runner import ModelRunner
from mlxcel.actors.pipeline import LocalPipeline
from mlxcel.actors.reasoning import detect_reasoning
from mlxcel.actors.scheduler import Scheduler
from mlxcel.actors.session_store import open_session_store
from mlxcel.actors.side_models import GenerationDisabled, start_side_models
from mlxcel.actors.stream_sessions import StreamSessions
from mlxcel.actors.streamer import Streamer
from mlxcel.actors.tokenizer import TokenizerActor
from mlxcel.actors.toolcalls import ToolFormat
from mlxcel.actors.toolcalls import detect as detect_tools
from mlxcel.drain import drain
from mlxcel.http.app import create_app
from mlxcel.http.context import ServerContext
from mlxcel.http.inflight import InFlight
from mlxcel.models import blas
from mlxcel.runtime.lora import LoraTable
from mlxcel.runtime.messages import SchedulerInbox, StepOutput, StepPlan, StreamerInbox, Submit
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.slot import AbortBox
from mlxcel.runtime.system import wait_for_stop_signal

log = logging.getLogger(__name__)


def build_mlx_backend(settings: Settings) -> Backend:
    """Runs on the model runner's thread: resolve, load, warm up."""
    from mlxcel.actors.model_runner.mlx_backend import MlxBackend
    from mlxcel.models.loader import load_model
    from mlxcel.models.resolve import resolve_model

    resolved = resolve_model(settings.model, settings.cache_dir)
    # --batch-invariant keeps every layer on float32 BLAS, whose results it has checked.
    loaded = load_model(
        resolved, keep_quantized=settings.keep_quantized, native=not settings.batch_invariant
    )
    if loaded.native_layers:
        log.info("%d quantised layers on mlxcel's native CPU kernels", loaded.native_layers)
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
            native=not settings.batch_invariant,
        )
        log.info("draft model %s (%s) from %s", draft.model_id, draft.dtype, draft.path)
    backend = MlxBackend(loaded, settings, draft)
    log.info("loaded %s from %s on %s", backend.info.description, loaded.path, backend.info.device)
    if settings.warmup:
        log.info("warmed up in %.2f s", backend.warmup())
    return backend


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


def choose_tool_format(flag: str, detected: ToolFormat | None) -> ToolFormat | None:
    """--tool-format: the template's own format, else generic (llama-server's fallback)."""
    if flag == "none":
        return None
    if flag == "auto":
        return detected or ToolFormat.GENERIC
    return ToolFormat(flag)


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
    build = build_backend or partial(build_mlx_backend, settings)
    aborts = AbortBox()
    metrics = Metrics()
    metrics.live.blas_threads = blas.threads
    plans_tx, plans_rx = trio.open_memory_channel[StepPlan](0)
    outputs_tx, outputs_rx = trio.open_memory_channel[StepOutput](0)
    stream_tx, stream_rx = trio.open_memory_channel[StreamerInbox](64)
    # Requests admitted but not started: up to --max-queue-depth waiting, plus --parallel on
    # their way to free slots (admission.py).
    tokenized_tx, tokenized_rx = trio.open_memory_channel[SchedulerInbox](
        settings.max_queue_depth + settings.parallel
    )
    submit_tx, submit_rx = trio.open_memory_channel[Submit](0)

    async with trio.open_nursery() as root:
        # Embedding / rerank workers; with -m <embedder> the chat model runner never starts.
        side = await start_side_models(root, settings, detect=build_backend is None)
        # Speech-to-text / text-to-speech workers: ready at once, models load on first use.
        audio = await start_audio(root, settings)
        info: ModelInfo = (
            await root.start(ModelRunner(build, plans_rx, outputs_tx).run)
            if side.generation
            else side.model_info()
        )
        if info.max_rows is not None and settings.parallel > info.max_rows:
            log.warning(
                "%s cannot decode requests side by side (models/vlm.py, Vision.batchable): "
                "serving %d at a time instead of --parallel %d",
                info.model_id,
                info.max_rows,
                settings.parallel,
            )
            settings = attrs.evolve(settings, parallel=info.max_rows)
        # Output formats are read off the chat template (and special tokens) once, here.
        tool_format = choose_tool_format(
            settings.tool_format, detect_tools(info.chat_template, info.tokenizer.get_vocab())
        )
        reasoning = detect_reasoning(info.chat_template)
        # What the streamer takes out of the text: --reasoning-format none keeps thinking in
        # it, --skip-chat-parsing keeps everything (the prompt side, tools rendered and
        # thinking budgets, is unchanged).
        split_reasoning = None if settings.reasoning_format == "none" else reasoning
        parse_calls = tool_format
        if settings.skip_chat_parsing:
            split_reasoning = parse_calls = None
        await root.start(
            Streamer(
                info.tokenizer,
                info.eos_token_ids,
                stream_rx,
                aborts,
                metrics,
                reasoning=split_reasoning,
                tool_format=parse_calls,
            ).run
        )
        scheduler = Scheduler(
            parallel=settings.parallel,
            inbox=tokenized_rx,
            plans=plans_tx,
            outputs=outputs_rx,
            streamer=stream_tx,
            aborts=aborts,
            metrics=metrics,
            join_window=settings.join_window,
        )
        await root.start(scheduler.run)
        tokenizer = TokenizerActor(
            tokenizer=info.tokenizer,
            context_length=info.context_length,
            reasoning=reasoning,
            n_predict=settings.n_predict,
            context_shift=settings.context_shift,
            inbox=submit_rx,
            outbox=tokenized_tx,
            tool_format=tool_format,
            media=info.media,
        )
        await root.start(tokenizer.run)
        lora = LoraTable(info.lora_paths, info.lora_scales)
        gate = Admission if side.generation else GenerationDisabled
        admission = gate(
            max_queue_depth=settings.max_queue_depth,
            outbox=submit_tx,
            aborts=aborts,
            parallel=settings.parallel,
            free_slots=scheduler.free_rows,
            lora=lora,
        )
        await root.start(admission.run)
        session_store = open_session_store(settings)
        await root.start(session_store.run)
        streams = StreamSessions()
        await root.start(streams.run)

        ctx = ServerContext(
            settings=settings,
            embedder=side.embedder,
            reranker=side.reranker,
            generation=side.generation,
            info=info,
            pipeline=LocalPipeline(admission, tokenizer, scheduler, tokenized_tx.clone()),
            metrics=metrics,
            tool_format=tool_format,
            session_store=session_store,
            stt=audio.stt,
            tts=audio.tts,
            streams=streams,
            lora=lora,
        )
        metrics.live.scheduler = scheduler.statistics
        metrics.live.queued = lambda: admission.queued
        workers = {"embedding": side.embedder, "rerank": side.reranker}
        metrics.live.side_jobs = lambda: {
            name: (w.queued, w.working) for name, w in workers.items() if w is not None
        }
        app = InFlight(create_app(ctx, webui=webui))
        metrics.live.in_flight = lambda: app.active
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
        log.info("serving %s on %s", info.model_id, ", ".join(binds))
        task_status.started((binds, ctx))

        if stop is None:
            await wait_for_stop_signal()
        else:
            await stop.wait()
        await drain(admission, ctx.long_lived, app, settings.graceful_timeout)
        # Hypercorn's own grace period would also wait for idle keep-alive connections, so it
        # only gets a short one: by now every response has been written.
        http_stop.set()
        await http_done.wait()
        log.info("stopped")
        root.cancel_scope.cancel()
