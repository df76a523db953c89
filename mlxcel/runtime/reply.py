"""The answer box of one embedder job: the worker fills it, the handler waits on it.

It lives in the runtime, beside ``OutputSlot``, because the messages that carry it
(``EmbedTexts``, ``ScorePairs``) do.
"""

from __future__ import annotations

import trio

from mlxcel.runtime.errors import MlxcelError
from mlxcel.runtime.messages import Embedded


class EmbedReply:
    """One job's answer box: the worker fills it, the handler waits on it."""

    def __init__(self) -> None:
        self._done = trio.Event()
        self._result: Embedded | None = None
        self._error: MlxcelError | None = None
        # Read by the worker thread between micro-batches (a plain bool: a stale read only
        # costs one more micro-batch).
        self.cancelled = False

    def cancel(self) -> None:
        """Nobody waits any more: the worker drops what of this job has not run yet."""
        self.cancelled = True

    def set_result(self, result: Embedded) -> None:
        self._result = result
        self._done.set()

    def set_error(self, error: MlxcelError) -> None:
        self._error = error
        self._done.set()

    async def wait(self) -> Embedded:
        """The job's result, or its error raised here. Cancelling the wait leaves the job
        queued: the caller marks it cancelled (``cancel``) so the worker skips it."""
        await self._done.wait()
        if self._error is not None:
            raise self._error
        assert self._result is not None
        return self._result
