"""The embedder actor: one worker thread that owns an embedding or reranking model.

Like the model runner, the thread is started once with
``trio.to_thread.run_sync(..., abandon_on_cancel=False)``, builds the model there (every mlx
object of it lives on that thread) and serves jobs until cancelled; it is never the generation
thread, so a long embedding batch does not stall decoding.

Each turn takes every job waiting in the bounded inbox, tokenises them, sorts all their items by
length (so padding is small) and runs micro-batches of ``batch_size``. A job is answered as soon
as its last item is computed; results are in request order. A handler that stops waiting (client
gone, timeout) marks its job cancelled and the worker skips whatever of it has not run yet.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import trio

from mlxcel.actors.own_thread import run_on_own_thread
from mlxcel.models.embedder_info import EmbedderInfo, Encoded
from mlxcel.runtime.errors import InternalError, MlxcelError, ServerBusy, Timeout, Unavailable
from mlxcel.runtime.messages import Embedded, EmbedderInbox, EmbedInput, EmbedTexts, ScorePairs
from mlxcel.runtime.reply import EmbedReply

log = logging.getLogger(__name__)


class EmbeddingBackend(Protocol):
    """Built and used only on the embedder's thread."""

    info: EmbedderInfo

    def encode_texts(self, inputs: Sequence[EmbedInput]) -> list[Encoded]: ...

    def encode_pairs(self, query: str, documents: Sequence[str]) -> list[Encoded]: ...

    def forward(self, batch: Sequence[Encoded]) -> Any:
        """``[n, dim]`` float32 vectors, or ``[n]`` scores for a cross-encoder (numpy)."""
        ...


@attrs.define
class _Job:
    message: EmbedderInbox
    items: list[Encoded]
    rows: list[Any]
    left: int


class Embedder:
    def __init__(
        self,
        build: Callable[[], EmbeddingBackend],
        *,
        batch_size: int = 16,
        queue_depth: int = 8,
        timeout: float = 120.0,
    ) -> None:
        self._build = build
        self.batch_size = batch_size
        self.timeout = timeout
        self._tx, self._rx = trio.open_memory_channel[EmbedderInbox](queue_depth)
        self._ids = itertools.count()
        self.info: EmbedderInfo | None = None
        # Jobs the worker thread has taken and is computing (written by that thread only).
        self.working = 0

    @property
    def queued(self) -> int:
        """Jobs waiting for the worker (at most ``queue_depth``; one more is a 503)."""
        return self._tx.statistics().current_buffer_used

    # -- the handler side -------------------------------------------------------------------

    def _submit(self, make: Callable[[str, EmbedReply], EmbedderInbox]) -> EmbedReply:
        if self.info is None:
            raise Unavailable("Loading model")
        reply = EmbedReply()
        try:
            self._tx.send_nowait(make(f"emb-{next(self._ids)}", reply))
        except trio.WouldBlock:
            raise ServerBusy() from None
        return reply

    async def _call(self, make: Callable[[str, EmbedReply], EmbedderInbox]) -> Embedded:
        reply = self._submit(make)
        try:
            with trio.move_on_after(self.timeout):
                return await reply.wait()
            raise Timeout(f"The embedding worker did not answer within {self.timeout:g} s.")
        finally:
            reply.cancel()

    async def embed(self, inputs: Sequence[EmbedInput]) -> Embedded:
        """Vectors for ``inputs`` in order. ServerBusy when the queue is full, Timeout (504)
        after ``timeout``; on cancellation the job is dropped before its next micro-batch."""
        return await self._call(lambda rid, reply: EmbedTexts(rid, tuple(inputs), reply))

    async def score(self, query: str, documents: Sequence[str]) -> Embedded:
        """Cross-encoder scores in [0, 1] for each document, in order (same rules as embed)."""
        return await self._call(lambda rid, reply: ScorePairs(rid, query, tuple(documents), reply))

    # -- the actor ----------------------------------------------------------------------------

    async def run(
        self, *, task_status: trio.TaskStatus[EmbedderInfo] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load the model on a thread of its own (``actors.own_thread``), report ready, then
        serve jobs until cancelled.

        Cancellation closes the job queue, which reaches the thread at its next wait for a
        job; a micro-batch in progress finishes first (mlx work cannot be interrupted).
        """
        stopping = False

        def started(info: EmbedderInfo) -> None:
            self.info = info
            if not stopping:
                task_status.started(info)

        def stop() -> None:
            nonlocal stopping
            stopping = True
            self._rx.close()

        await run_on_own_thread(
            lambda token: self._thread_main(started, token),
            name="mlxcel-embedder",
            on_cancel=stop,
        )

    def _thread_main(
        self, started: Callable[[EmbedderInfo], None], token: trio.lowlevel.TrioToken
    ) -> None:
        self._token = token
        try:
            backend = self._build()
            trio.from_thread.run_sync(started, backend.info, trio_token=token)
            while True:
                try:
                    first = trio.from_thread.run(self._rx.receive, trio_token=token)
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                jobs = [first, *trio.from_thread.run_sync(self._drain, trio_token=token)]
                self.working = len(jobs)
                try:
                    self._serve(backend, jobs)
                finally:
                    self.working = 0
        finally:
            from mlxcel.models.loader import release_thread_streams

            release_thread_streams()

    def _drain(self) -> list[EmbedderInbox]:
        jobs = []
        while True:
            try:
                jobs.append(self._rx.receive_nowait())
            except trio.WouldBlock:
                return jobs

    def _serve(self, backend: EmbeddingBackend, messages: list[EmbedderInbox]) -> None:
        jobs: list[_Job] = []
        for message in messages:
            if message.reply.cancelled:
                continue
            try:
                match message:
                    case EmbedTexts(inputs=inputs):
                        items = backend.encode_texts(inputs)
                    case ScorePairs(query=query, documents=documents):
                        items = backend.encode_pairs(query, documents)
            except Exception as error:  # noqa: BLE001 - a bad input fails its own job only
                log.exception("tokenising %s failed", message.request_id)
                self._reply(message, error=InternalError(f"Tokenisation failed: {error}"))
                continue
            jobs.append(_Job(message, items, [None] * len(items), len(items)))
            if not items:
                self._finish(jobs[-1])
        order = sorted(
            (
                (len(item.ids), j, i)
                for j, job in enumerate(jobs)
                for i, item in enumerate(job.items)
            ),
        )
        for start in range(0, len(order), self.batch_size):
            chunk = [(j, i) for _, j, i in order[start : start + self.batch_size]]
            chunk = [
                (j, i) for j, i in chunk if jobs[j].left > 0 and not jobs[j].message.reply.cancelled
            ]
            if not chunk:
                continue
            try:
                values = backend.forward([jobs[j].items[i] for j, i in chunk])
            except Exception as error:  # noqa: BLE001 - the batch's jobs fail, the worker lives
                log.exception("embedding forward failed")
                for j in {j for j, _ in chunk}:
                    if jobs[j].left > 0:
                        jobs[j].left = 0
                        self._reply(
                            jobs[j].message, error=InternalError(f"Forward failed: {error}")
                        )
                continue
            for row, (j, i) in enumerate(chunk):
                job = jobs[j]
                job.rows[i] = values[row]
                job.left -= 1
                if job.left == 0:
                    self._finish(job)

    def _finish(self, job: _Job) -> None:
        import numpy as np

        values = np.stack(job.rows) if job.rows else np.zeros((0,), dtype=np.float32)
        if not bool(np.isfinite(values).all()):
            self._reply(job.message, error=InternalError("The model produced non-finite output."))
            return
        counts = tuple(len(item.ids) for item in job.items)
        self._reply(job.message, result=Embedded(values, counts))

    def _reply(
        self,
        message: EmbedderInbox,
        *,
        result: Embedded | None = None,
        error: MlxcelError | None = None,
    ) -> None:
        reply = message.reply
        if error is not None:
            trio.from_thread.run_sync(reply.set_error, error, trio_token=self._token)
        else:
            assert result is not None
            trio.from_thread.run_sync(reply.set_result, result, trio_token=self._token)
