"""The model runner actor: one OS thread owns the model and every mlx object.

The thread is a fresh ``threading.Thread`` per model, never one of Trio's cached worker
threads: mlx keeps per-thread streams that the thread releases when it ends
(``release_thread_streams``), and a thread reused after that cannot run mlx again (router mode
loads and unloads models through the life of the server). It builds the backend (loading the
model and warming it up), reports the model facts through ``task_status.started``, then serves
plans: receive a ``StepPlan``, apply it, send back the ``StepOutput``. The Trio side never
touches an ``mx.array``.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable

import trio

from mlxcel.actors.model_runner.backend import Backend, ModelInfo
from mlxcel.runtime.messages import StepOutput, StepPlan

log = logging.getLogger(__name__)


class ModelRunner:
    def __init__(
        self,
        build: Callable[[], Backend],
        plans: trio.MemoryReceiveChannel[StepPlan],
        outputs: trio.MemorySendChannel[StepOutput],
    ) -> None:
        self._build = build
        self._plans = plans
        self._outputs = outputs
        self._stopping = False

    async def run(
        self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load, warm up, report ready, then serve plans until cancelled.

        Cancellation closes the runner's channel ends, which reaches the thread at its next
        wait for a plan (or for the scheduler to take an output); a step in progress finishes
        first, since mlx work cannot be interrupted, and this waits for the thread to end
        (the backend closed, its memory released) before it returns.
        """
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        failure: list[BaseException] = []

        def report(info: ModelInfo) -> None:
            if not self._stopping:
                task_status.started(info)

        def main() -> None:
            try:
                self._thread_main(report, token)
            except BaseException as exc:  # handed to the Trio side, raised there
                failure.append(exc)
            finally:
                with contextlib.suppress(trio.RunFinishedError):
                    token.run_sync_soon(done.set)

        threading.Thread(target=main, name="mlxcel-model-runner", daemon=True).start()
        try:
            await done.wait()
        except trio.Cancelled:
            self._stopping = True
            self._plans.close()
            self._outputs.close()
            with trio.CancelScope(shield=True):
                await done.wait()
            raise
        if failure:
            raise failure[0]

    def _thread_main(
        self, report: Callable[[ModelInfo], None], token: trio.lowlevel.TrioToken
    ) -> None:
        backend = self._build()
        try:
            trio.from_thread.run_sync(report, backend.info, trio_token=token)
            while True:
                try:
                    plan = trio.from_thread.run(self._plans.receive, trio_token=token)
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                output = backend.apply(plan)
                try:
                    trio.from_thread.run(self._outputs.send, output, trio_token=token)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
        finally:
            backend.close()
