"""The model runner actor: one OS thread owns the model and every mlx object.

The thread is started once with ``trio.to_thread.run_sync(..., abandon_on_cancel=False)`` and
lives as long as the server. It builds the backend (loading the model and warming it up) on
that thread, reports the model facts through ``task_status.started``, then serves plans:
receive a ``StepPlan``, apply it, send back the ``StepOutput``. The Trio side never touches an
``mx.array``.
"""

from __future__ import annotations

import logging
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

    async def run(
        self, *, task_status: trio.TaskStatus[ModelInfo] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """Load, warm up, report ready, then serve plans until cancelled.

        Cancellation reaches the thread at its next wait for a plan (``from_thread.run``
        raises ``trio.Cancelled`` there); a step in progress finishes first, since mlx work
        cannot be interrupted.
        """
        await trio.to_thread.run_sync(self._thread_main, task_status, abandon_on_cancel=False)

    def _thread_main(self, task_status: trio.TaskStatus[ModelInfo]) -> None:
        backend = self._build()
        try:
            trio.from_thread.run_sync(task_status.started, backend.info)
            while True:
                try:
                    plan = trio.from_thread.run(self._plans.receive)
                except trio.EndOfChannel:
                    return
                output = backend.apply(plan)
                trio.from_thread.run(self._outputs.send, output)
        finally:
            backend.close()
