"""One model's pipeline: model runner, streamer, scheduler, tokenizer and admission, wired
with their own bounded channels in a nursery of their own.

A server runs one of these per loaded model (router mode runs several, started and stopped
by ``actors.registry``). Cancelling the pipeline's nursery unloads the model: the runner's
thread leaves at its next wait for a plan and closes the backend, and once nothing refers to
the model any more its arrays are freed.

Start order (each waits for the previous one's ``started``): model runner (loads and warms
up the model on its own thread) -> streamer -> scheduler -> tokenizer -> admission.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import attrs
import trio

from mlxcel.actors.admission import Admission
from mlxcel.actors.embedder import Embedder
from mlxcel.actors.model_runner.backend import Backend, ModelInfo
from mlxcel.actors.model_runner.runner import ModelRunner
from mlxcel.actors.pipeline import LocalPipeline
from mlxcel.actors.reasoning import detect_reasoning
from mlxcel.actors.scheduler import Scheduler
from mlxcel.actors.streamer import Streamer
from mlxcel.actors.tokenizer import TokenizerActor
from mlxcel.actors.toolcalls import ToolFormat
from mlxcel.actors.toolcalls import detect as detect_tools
from mlxcel.runtime.lora import LoraTable
from mlxcel.runtime.messages import SchedulerInbox, StepOutput, StepPlan, StreamerInbox, Submit
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.slot import AbortBox

log = logging.getLogger(__name__)


@attrs.frozen(eq=False)
class Hosted:
    """A loaded model as the rest of the server sees it."""

    name: str
    info: ModelInfo
    pipeline: LocalPipeline
    # The tool-call format in use (None: --tool-format none, tools are refused).
    tool_format: ToolFormat | None
    # Rows that decode together: --parallel, or fewer for a model that cannot batch.
    parallel: int
    # False: a server without a chat model (-m <embedder>): every generation is a 501.
    generation: bool = True
    # Router mode: an embedding or reranking model of the list is served by its worker.
    embedder: Embedder | None = None
    reranker: Embedder | None = None
    # Its --lora adapters and their global scales (/lora-adapters); empty without.
    lora: LoraTable = attrs.field(factory=LoraTable)

    @property
    def admission(self) -> Admission:
        return self.pipeline.admission


def choose_tool_format(flag: str, detected: ToolFormat | None) -> ToolFormat | None:
    """--tool-format: the template's own format, else generic (llama-server's fallback)."""
    if flag == "none":
        return None
    if flag == "auto":
        return detected or ToolFormat.GENERIC
    return ToolFormat(flag)


async def host_model(
    name: str | None,
    settings: Settings,
    build: Callable[[], Backend] | None,
    metrics: Metrics,
    *,
    side_info: ModelInfo | None = None,
    disabled: type[Admission] | None = None,
    embedder: Embedder | None = None,
    reranker: Embedder | None = None,
    task_status: trio.TaskStatus[Hosted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Load the model, start its actors, report it as ``Hosted``, then run until cancelled.
    ``name``: what requests call it (None: the model's own id, ``--alias`` included).

    ``build`` runs on the model runner's thread (resolve, load, warm up); a failure there is
    raised from here before ``started``. Without ``build`` no chat model runs (``side_info``
    describes the side model served instead, and ``disabled`` answers every generation).

    Cancellation stops every actor of this model; the model runner's thread finishes the step
    it is in, closes the backend and leaves.
    """
    aborts = AbortBox()
    plans_tx, plans_rx = trio.open_memory_channel[StepPlan](0)
    outputs_tx, outputs_rx = trio.open_memory_channel[StepOutput](0)
    stream_tx, stream_rx = trio.open_memory_channel[StreamerInbox](64)
    # Requests admitted but not started: up to --max-queue-depth waiting, plus --parallel on
    # their way to free slots (admission.py).
    tokenized_tx, tokenized_rx = trio.open_memory_channel[SchedulerInbox](
        settings.max_queue_depth + settings.parallel
    )
    submit_tx, submit_rx = trio.open_memory_channel[Submit](0)
    async with trio.open_nursery() as nursery:
        if build is not None:
            info: ModelInfo = await nursery.start(ModelRunner(build, plans_rx, outputs_tx).run)
        else:
            assert side_info is not None
            info = side_info
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
        await nursery.start(
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
        await nursery.start(scheduler.run)
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
        await nursery.start(tokenizer.run)
        lora = LoraTable(info.lora_paths, info.lora_scales)
        gate = disabled or Admission
        admission = gate(
            max_queue_depth=settings.max_queue_depth,
            outbox=submit_tx,
            aborts=aborts,
            parallel=settings.parallel,
            free_slots=scheduler.free_rows,
            lora=lora,
        )
        await nursery.start(admission.run)
        pipeline = LocalPipeline(admission, tokenizer, scheduler, tokenized_tx.clone())
        task_status.started(
            Hosted(
                name or info.model_id,
                info,
                pipeline,
                tool_format,
                settings.parallel,
                generation=disabled is None,
                embedder=embedder,
                reranker=reranker,
                lora=lora,
            )
        )
