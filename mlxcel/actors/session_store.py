"""The session-store actor: owns stored Responses, conversations, and the running responses.

Stored documents live in embedded SQLite (``session_db.SessionDB``) under the cache dir, or in
PostgreSQL shared by several replicas (``session_pg.PgSessionDB``, ``--store postgresql://``).
All database calls run on one worker thread that this actor starts and owns; callers on the Trio
thread ``await`` the methods below and never touch the database. Writes are committed before
a method returns, so whatever a client was told is stored survives a restart or ``kill -9``.

The actor also keeps the registry of responses being generated right now (process-local, not
persisted), so that ``POST /v1/responses/{id}/cancel`` can stop one and ``GET`` can show it.
The registry is the actor's own: a handler enters and leaves it through ``begin_running`` /
``end_running``, and stopping another request's response is a message (``CancelResponse``)
that the actor acts on, waits on and answers, so a canceller that leaves half-way changes
nothing.

With a shared store the registry is also listed in the database: another replica's GET shows a
response running here, and its ``/cancel`` reaches this replica by ``NOTIFY`` (the listener
thread hands the id to the Trio thread, which cancels it here); that replica then waits until
the response left the list and reads the stored result. One replica at a time sweeps expired
rows, every ``SWEEP_EVERY`` seconds.
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
from mlxcel.actors.session_pg import PgSessionDB, redact
from mlxcel.runtime.errors import StoreUnavailable
from mlxcel.runtime.messages import CancelReply, CancelResponse, SessionStoreInbox
from mlxcel.runtime.settings import Settings
from mlxcel.runtime.slot import OutputSlot

log = logging.getLogger(__name__)

T = TypeVar("T")
Backend = SessionDB | PgSessionDB
_Job = Callable[[Backend], None]
SESSION_DB = "sessions.sqlite3"
# Seconds between sweeps of a shared store (a replica that finds another sweeping skips).
SWEEP_EVERY = 30.0
# How often a cancel polls a shared store for the end of a response another replica runs.
REMOTE_POLL = 0.05
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
        self._token: trio.lowlevel.TrioToken | None = None

    @property
    def shared(self) -> bool:
        return is_url(self.path)

    def enabled(self, table: Table) -> bool:
        return self.limits[table].enabled

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Open the database on the store's thread and serve calls until cancelled.

        On cancellation the thread finishes the call it is running (a transaction is never cut
        in half), closes the database and exits; this coroutine waits for that, shielded."""
        self._token = trio.lowlevel.current_trio_token()
        thread = threading.Thread(target=self._serve, name="session-store", daemon=True)
        thread.start()
        try:
            # Waits until the database is open (a failure to open even in memory is raised).
            await self.call(lambda db: None)
            log.info("session store at %s", redact(str(self.path)))
            task_status.started()
            async with trio.open_nursery() as nursery:
                if self.shared:
                    nursery.start_soon(self._sweep)
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

    def _open(self) -> Backend:
        if is_url(self.path):
            # Unreachable at start is no failure: calls answer 503 until it is back.
            return PgSessionDB(str(self.path), self.limits, on_cancel=self._cancel_from_peer)
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

    async def call(self, fn: Callable[[Backend], T]) -> T:
        """Run ``fn(db)`` on the store's thread and return its result (or raise its error).

        Cancellation: the caller stops waiting, but a call already queued still runs to its
        commit; nothing is left half-written."""
        token = trio.lowlevel.current_trio_token()
        done = trio.Event()
        result: list[outcome.Outcome[T]] = []

        def job(db: Backend) -> None:
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
        if self.shared:
            body = running.snapshot()
            self._post(lambda db: db.mark_running(response_id, body))

    def end_running(self, response_id: str) -> None:
        """Its handler is done with it (stored, if asked to). Idempotent."""
        if self._running.pop(response_id, None) is not None and self.shared:
            # Queued after the handler's store.put, so a peer that sees the row gone finds
            # the stored response.
            self._post(lambda db: db.unmark_running(response_id))

    def _post(self, fn: Callable[[Backend], None]) -> None:
        """Run ``fn`` on the store's thread without waiting; a failure is only logged (the
        response itself goes on, visible to this replica)."""

        def job(db: Backend) -> None:
            try:
                fn(db)
            except StoreUnavailable as error:
                log.warning("session store: %s", error)
            except Exception:
                log.exception("session store call failed")

        self._jobs.put(job)

    def running_snapshot(self, response_id: str) -> dict[str, Any] | None:
        """The response as it stands now, if it is being generated."""
        running = self._running.get(response_id)
        return running.snapshot() if running is not None else None

    def running_ids(self) -> tuple[str, ...]:
        return tuple(self._running)

    async def shared_running(self, response_id: str) -> dict[str, Any] | None:
        """The response as it started, when another replica of a shared store runs it."""
        if not self.shared:
            return None
        return await self.call(lambda db: db.running_body(response_id))

    async def cancel_running(self, response_id: str) -> dict[str, Any] | None:
        """Ask the store to stop this response; returns it as it ended (its handler had up to
        ``CANCEL_WAIT`` seconds to store it), or None when none by that id was running here
        or, with a shared store, on another replica.

        Cancellation: the caller stops waiting; the cancel, once sent, still happens."""
        reply = CancelReply(trio.Event())
        await self._inbox_tx.send(CancelResponse(response_id, reply))
        await reply.done.wait()
        if reply.snapshot is None and self.shared:
            return await self._cancel_remote(response_id)
        return reply.snapshot

    async def _cancel_remote(self, response_id: str) -> dict[str, Any] | None:
        body = await self.shared_running(response_id)
        if body is None:
            return None
        await self.call(lambda db: db.notify_cancel(response_id))
        # The replica that runs it stores it cancelled, then takes it off the list.
        with trio.move_on_after(CANCEL_WAIT):
            # Polled: the end happens in another process, and only the database sees it.
            while True:
                if await self.shared_running(response_id) is None:
                    break
                await trio.sleep(REMOTE_POLL)
        return {**body, "status": "cancelled"}

    def _cancel_from_peer(self, response_id: str) -> None:
        """On the listener thread: another replica asked to cancel ``response_id``."""
        token = self._token
        if token is None:
            return
        try:
            token.run_sync_soon(self._cancel_here, response_id)
        except trio.RunFinishedError:
            pass

    def _cancel_here(self, response_id: str) -> None:
        # On the Trio thread, so the registry is read as the actor reads it; the peer waits on
        # the database, not on an answer from here.
        running = self._running.get(response_id)
        if running is not None:
            running.cancel()

    async def _sweep(self) -> None:
        while True:
            await trio.sleep(SWEEP_EVERY)
            try:
                await self.call(lambda db: db.sweep())
            except StoreUnavailable as error:
                log.warning("session store sweep skipped: %s", error)

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

        def job(db: Backend) -> dict[str, Any] | None:
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


def is_url(path: Path | str) -> bool:
    return isinstance(path, str) and path.startswith(("postgresql://", "postgres://"))


def open_session_store(settings: Settings) -> SessionStore:
    """The store the server's flags describe: ``--store`` (a PostgreSQL URL or a SQLite file),
    else ``<cache dir>/sessions.sqlite3``."""
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
    store = settings.store
    if store is not None and is_url(store):
        return SessionStore(store, limits) if on else SessionStore(":memory:", limits)
    path = Path(store) if store is not None else settings.cache_dir / SESSION_DB
    # With both stores off nothing is written to disk.
    return SessionStore(path if on else ":memory:", limits)
