"""The session-store actor: owns stored Responses, conversations, and the running responses.

Stored documents live in embedded SQLite (``session_db.SessionDB``) under the cache dir. All
sqlite3 calls run on one worker thread that this actor starts and owns; callers on the Trio
thread ``await`` the methods below and never touch the database. Writes are committed before
a method returns, so whatever a client was told is stored survives a restart or ``kill -9``.

The actor also keeps the registry of responses being generated right now (process-local, not
persisted), so that ``POST /v1/responses/{id}/cancel`` can stop one and ``GET`` can show it.
The registry is the actor's own: a handler enters and leaves it through ``begin_running`` /
``end_running``, and stopping another request's response is a message (``CancelResponse``)
that the actor acts on, waits on and answers, so a canceller that leaves half-way changes
nothing.
"""

from __future__ import annotations

import logging
import queue
import sqlite3
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar, assert_never

import outcome
import trio

from mlxcel.actors.session_db import Limits, SessionDB, Table
from mlxcel.runtime.messages import CancelReply, CancelResponse, SessionStoreInbox
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.slot import OutputSlot

log = logging.getLogger(__name__)

T = TypeVar("T")
_Job = Callable[[SessionDB], None]
SESSION_DB = "sessions.sqlite3"
# How long a cancel waits for the response's handler to end it and store it cancelled, so
# that a GET right after the cancel's answer sees it.
CANCEL_WAIT = 10.0


class Running:
    """A response being generated: its live snapshot, and how to stop it."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], slot: OutputSlot) -> None:
        self.snapshot = snapshot
        self.slot = slot
        self.cancel_requested = False
        # Set once the handler has finished the response (and stored it, if asked to).
        self.done = trio.Event()

    def cancel(self) -> None:
        """Abort the generation and wake its handler, which ends the response `cancelled`."""
        self.cancel_requested = True
        self.slot.cancel()
        # A request still waiting for a place would never hear of the abort: wake it here.
        self.slot.finish("abort")


class SessionStore:
    def __init__(self, path: Path | str, limits: dict[Table, Limits]) -> None:
        self.path = path
        self.limits = limits
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._running: dict[str, Running] = {}
        self._inbox_tx, self._inbox_rx = trio.open_memory_channel[SessionStoreInbox](16)

    def enabled(self, table: Table) -> bool:
        return self.limits[table].enabled

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the database on the store's thread and serve calls until cancelled.

        On cancellation the thread finishes the call it is running (a transaction is never cut
        in half), closes the database and exits; this coroutine waits for that, shielded."""
        thread = threading.Thread(target=self._serve, name="session-store", daemon=True)
        thread.start()
        try:
            # Waits until the database is open (a failure to open even in memory is raised).
            await self.call(lambda db: None)
            log.info("session store at %s", self.path)
            task_status.started()
            async with trio.open_nursery() as nursery:
                async for message in self._inbox_rx:
                    match message:
                        case CancelResponse():
                            self._cancel(nursery, message)
                        case _:
                            assert_never(message)
        finally:
            self._jobs.put(None)
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(thread.join)

    def _open(self) -> SessionDB:
        try:
            return SessionDB(self.path, self.limits)
        except (OSError, sqlite3.Error) as error:
            # A read-only or broken cache dir must not stop a server that may never serve
            # Responses: keep going in memory, and say that nothing will survive a restart.
            log.warning(
                "session store %s cannot be opened (%s): responses and conversations are kept "
                "in memory only and are lost on restart",
                self.path,
                error,
            )
            self.path = ":memory:"
            return SessionDB(self.path, self.limits)

    def _serve(self) -> None:
        try:
            db = self._open()
        except BaseException as error:  # reported to every caller instead of a dead thread
            failure = error
            while (job := self._jobs.get()) is not None:
                job(_Broken(failure))  # type: ignore[arg-type]  # stands in for a SessionDB
            return
        try:
            while (job := self._jobs.get()) is not None:
                job(db)
        finally:
            db.close()

    async def call(self, fn: Callable[[SessionDB], T]) -> T:
        """Run ``fn(db)`` on the store's thread and return its result (or raise its error).

        Cancellation: the caller stops waiting, but a call already queued still runs to its
        commit; nothing is left half-written."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []

        def job(db: SessionDB) -> None:
            result.append(outcome.capture(fn, db))
            try:
                token.run_sync_soon(done.set)
            except trio.RunFinishedError:
                pass

        self._jobs.put(job)
        await done.wait()
        return result[0].unwrap()

    # --- responses being generated ---------------------------------------------------------

    def begin_running(self, response_id: str, running: Running) -> None:
        """A handler started generating this response: GET shows it, /cancel can stop it."""
        self._running[response_id] = running

    def end_running(self, response_id: str) -> None:
        """Its handler is done with it (stored, if asked to). Idempotent."""
        self._running.pop(response_id, None)

    def running_snapshot(self, response_id: str) -> dict[str, Any] | None:
        """The response as it stands now, if it is being generated."""
        running = self._running.get(response_id)
        return running.snapshot() if running is not None else None

    def running_ids(self) -> tuple[str, ...]:
        return tuple(self._running)

    async def cancel_running(self, response_id: str) -> dict[str, Any] | None:
        """Ask the store to stop this response; returns it as it ended (its handler had up to
        ``CANCEL_WAIT`` seconds to store it), or None when none by that id was running.

        Cancellation: the caller stops waiting; the cancel, once sent, still happens."""
        reply = CancelReply(trio.Event())
        await self._inbox_tx.send(CancelResponse(response_id, reply))
        await reply.done.wait()
        return reply.snapshot

    def _cancel(self, nursery: trio.Nursery, message: CancelResponse) -> None:
        running = self._running.get(message.response_id)
        if running is None:
            message.reply.done.set()
            return
        running.cancel()
        nursery.start_soon(self._answer_cancel, running, message.reply)

    async def _answer_cancel(self, running: Running, reply: CancelReply) -> None:
        with trio.move_on_after(CANCEL_WAIT):
            await running.done.wait()
        reply.snapshot = running.snapshot()
        reply.done.set()

    # --- typed calls -----------------------------------------------------------------------

    async def get(self, table: Table, key: str) -> dict[str, Any] | None:
        return await self.call(lambda db: db.get(table, key))

    async def put(self, table: Table, key: str, body: dict[str, Any]) -> bool:
        return await self.call(lambda db: db.put(table, key, body))

    async def delete(self, table: Table, key: str) -> bool:
        return await self.call(lambda db: db.delete(table, key))

    async def update(
        self,
        table: Table,
        key: str,
        change: Callable[[dict[str, Any] | None], dict[str, Any] | None],
    ) -> dict[str, Any] | None:
        """Read, change and write one document as one call on the store's thread, so two
        requests appending to the same conversation cannot lose each other's items.

        ``change`` gets the stored body (None when absent) and returns the body to write, or
        None to write nothing; the result is what was written."""

        def job(db: SessionDB) -> dict[str, Any] | None:
            body = change(db.get(table, key))
            if body is not None:
                db.put(table, key, body)
            return body

        return await self.call(job)


class _Broken:
    """Stands in for a database that failed to open: every call raises the opening error."""

    def __init__(self, error: BaseException) -> None:
        self._error = error

    def __getattr__(self, name: str) -> Any:
        raise self._error


def open_session_store(settings: Settings) -> SessionStore:
    """The store the server's flags describe, in ``<cache dir>/sessions.sqlite3``."""
    limits: dict[Table, Limits] = {
        "responses": Limits(
            max_entries=settings.responses_store_max_entries,
            max_bytes=settings.responses_store_max_bytes,
            ttl_secs=settings.responses_store_ttl_secs,
        ),
        "conversations": Limits(
            max_entries=settings.conversation_store_max_entries,
            max_bytes=settings.conversation_store_max_bytes,
            ttl_secs=settings.conversation_store_ttl_secs,
        ),
    }
    on = any(lim.enabled for lim in limits.values())
    # With both stores off nothing is written to disk.
    return SessionStore(settings.cache_dir / SESSION_DB if on else ":memory:", limits)
