"""The model runner actor: one OS thread owns the model and every mlx object.

The thread is made for this model (``actors.own_thread``: never a reused Trio worker thread,
since router mode unloads and loads models through the life of the server). It builds the
backend (loading the model and warming it up), reports the model facts through
``task_status.started``, then serves plans: receive a ``StepPlan``, apply it, send back the
``StepOutput``. The Trio side never touches an ``mx.array``.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import trio

from mlxcel.actors.model_runner.backend import Backend, ModelInfo
from mlxcel.actors.own_thread import run_on_own_thread
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
        first, since mlx work cannot be interrupted, and this returns once the thread has
        closed the backend (its memory released).
        """

        def report(info: ModelInfo) -> None:
            if not self._stopping:
                task_status.started(info)

        def stop() -> None:
            self._stopping = True
            self._plans.close()
            self._outputs.close()

        await run_on_own_thread(
            lambda token: self._thread_main(report, token),
            name="mlxcel-model-runner",
            on_cancel=stop,
        )

    async def _next_plan(self, wait_s: float) -> StepPlan | None:
        with trio.move_on_after(wait_s):
            return await self._plans.receive()
        return None

    def _thread_main(
        self, report: Callable[[ModelInfo], None], token: trio.lowlevel.TrioToken
    ) -> None:
        backend = self._build()
        # --distributed: rank 0's backend pings the other ranks when no plan came for this
        # long (distributed.py); None everywhere else, where the wait has no timeout.
        heartbeat_s: float | None = getattr(backend, "heartbeat_s", None)
        try:
            trio.from_thread.run_sync(report, backend.info, trio_token=token)
            while True:
                try:
                    if heartbeat_s is None:
                        plan = trio.from_thread.run(self._plans.receive, trio_token=token)
                    elif (
                        got := trio.from_thread.run(self._next_plan, heartbeat_s, trio_token=token)
                    ) is None:
                        backend.heartbeat()  # type: ignore[attr-defined]  # set with heartbeat_s
                        continue
                    else:
                        plan = got
                except (trio.EndOfChannel, trio.ClosedResourceError):
                    return
                output = backend.apply(plan)
                try:
                    trio.from_thread.run(self._outputs.send, output, trio_token=token)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    return
        finally:
            backend.close()
