"""The generation pipeline as HTTP sees it: one object over admission, tokenizer and scheduler.

Handlers get this (typed as ``mlxcel.http.context.Pipeline``), never the actors: they submit a
generation, count a request's prompt tokens, read frozen statistics, and send the scheduler
control messages. Built once by ``server.py``, the composition root.
"""

from __future__ import annotations

import attrs
import trio

from mlxcel.actors.admission import Admission
from mlxcel.actors.scheduler import Scheduler
from mlxcel.actors.tokenizer import TokenizerActor
from mlxcel.runtime.messages import (
    AudioRef,
    GenerationRequest,
    ImageRef,
    SchedulerControl,
    SchedulerInbox,
    SchedulerStatistics,
)
from mlxcel.runtime.slot import OutputSlot


@attrs.frozen
class LocalPipeline:
    """The one chat model's pipeline in this process (a router would hold one per model)."""

    admission: Admission
    tokenizer: TokenizerActor
    scheduler: Scheduler
    # The scheduler's inbox; only control messages go this way (work goes through admission).
    inbox: trio.MemorySendChannel[SchedulerInbox]

    @property
    def draining(self) -> bool:
        return self.admission.draining

    @property
    def reasons(self) -> bool:
        """The chat template has thinking blocks (so a completion's can be ended)."""
        return self.tokenizer.reasoning is not None

    def submit(self, request: GenerationRequest) -> OutputSlot:
        return self.admission.submit(request)

    def count_tokens(self, request: GenerationRequest) -> int:
        """The prompt's length in tokens. Images and audio count as the processor expands
        them once http/ has read them; references not read yet count as their markers."""
        read = any(not isinstance(i, ImageRef) for i in request.images) or any(
            not isinstance(a, AudioRef) for a in request.audio
        )
        if read:
            return len(self.tokenizer.prepare_media(request).tokens)
        return len(self.tokenizer.encode(request))

    def render(self, request: GenerationRequest) -> str:
        return self.tokenizer.render(request)

    def statistics(self) -> SchedulerStatistics:
        return self.scheduler.statistics()

    async def control(self, message: SchedulerControl) -> None:
        await self.inbox.send(message)
