"""The session store's database when replicas share one: stored responses and conversations in
PostgreSQL (``--store postgresql://...``).

The same contract as ``session_db.SessionDB`` (one committed transaction per call, bounds by
entry count, bytes and TTL, oldest first), plus what several replicas need:

- the schema is created and migrated at start under an advisory lock, and its version is kept
  in ``mlxcel_schema``, so replicas of different versions never race a migration;
- a write and its eviction run under a per-table transaction lock, so the bounds hold for the
  whole cluster, not per replica;
- responses being generated are listed in ``mlxcel_running`` with the backend pid of their
  replica's listener connection; another replica's ``/cancel`` sends ``NOTIFY mlxcel_cancel``
  and the listener thread of the replica that runs it wakes the actor (``on_cancel``). A row
  whose listener is gone (its replica died) is swept;
- one replica at a time sweeps expired rows (``pg_try_advisory_xact_lock``).

Synchronous psycopg 3 (its async API does not run on Trio), used only from the session-store
actor's thread; the listener has its own thread and connection. A database that cannot be
reached turns every call into ``StoreUnavailable`` (503), never a crash.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg_pool import ConnectionPool, PoolTimeout

from mlxcel.actors.session_db import TABLES, Limits, Table
from mlxcel.runtime.errors import StoreUnavailable

log = logging.getLogger(__name__)

CHANNEL = "mlxcel_cancel"
# How long a store call waits for a connection before it answers 503.
CONNECT_TIMEOUT = 3.0
# Advisory lock keys (any fixed bigints; "mlx" in ASCII, then a kind).
_MIGRATE_KEY = 0x6D6C78_01
_SWEEP_KEY = 0x6D6C78_02
_TABLE_KEY: dict[Table, int] = {"responses": 0x6D6C78_10, "conversations": 0x6D6C78_11}

# Each entry moves the schema one version up; never edit one that has shipped, append.
_MIGRATIONS: tuple[str, ...] = (
    """
    CREATE TABLE mlxcel_responses (
        id TEXT PRIMARY KEY, written DOUBLE PRECISION NOT NULL,
        nbytes BIGINT NOT NULL, body TEXT NOT NULL);
    CREATE INDEX mlxcel_responses_age ON mlxcel_responses (written, id);
    CREATE TABLE mlxcel_conversations (
        id TEXT PRIMARY KEY, written DOUBLE PRECISION NOT NULL,
        nbytes BIGINT NOT NULL, body TEXT NOT NULL);
    CREATE INDEX mlxcel_conversations_age ON mlxcel_conversations (written, id);
    -- responses being generated now; owner: pg_backend_pid() of the replica's listener
    CREATE TABLE mlxcel_running (
        id TEXT PRIMARY KEY, owner INTEGER NOT NULL,
        started DOUBLE PRECISION NOT NULL, body TEXT NOT NULL);
    """,
)
SCHEMA_VERSION = len(_MIGRATIONS)


def redact(url: str) -> str:
    """The URL without its password, for logs."""
    return re.sub(r"(://[^:/@]*):[^@]*@", r"\1:***@", url)


def _text(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class PgSessionDB:
    shared = True

    def __init__(
        self,
        url: str,
        limits: dict[Table, Limits],
        *,
        clock: Callable[[], float] = time.time,
        on_cancel: Callable[[str], None] | None = None,
    ) -> None:
        self.url = url
        self.limits = limits
        self._clock = clock
        self._on_cancel = on_cancel
        self._migrated = False
        self.pool = ConnectionPool(
            url,
            min_size=1,
            max_size=2,
            open=False,
            timeout=CONNECT_TIMEOUT,
            # A connection broken by a database restart is noticed before use, not by a call.
            check=ConnectionPool.check_connection,
            kwargs={"autocommit": True, "connect_timeout": int(CONNECT_TIMEOUT)},
            name="mlxcel-session-store",
        )
        self.pool.open(wait=False)
        self._stop = threading.Event()
        self.owner: int | None = None
        self._owner_ready = threading.Event()
        self._listener = threading.Thread(target=self._listen, name="session-listen", daemon=True)
        self._listener.start()
        try:
            self._migrate()
        except StoreUnavailable as error:  # the server starts anyway; calls retry the migration
            log.error("session store %s is unreachable at start: %s", redact(url), error)

    def close(self) -> None:
        self._stop.set()
        self._listener.join(timeout=5.0)
        self.pool.close()

    # --- connections -----------------------------------------------------------------------

    @contextmanager
    def _conn(self) -> Iterator[psycopg.Connection[Any]]:
        """A pooled connection, migrated; an unreachable database is ``StoreUnavailable``."""
        try:
            with self.pool.connection() as conn:
                if not self._migrated:
                    self._migrate_on(conn)
                yield conn
        except (psycopg.OperationalError, PoolTimeout) as error:
            raise StoreUnavailable(
                f"The session store (PostgreSQL) is unavailable: {str(error).strip()}"
            ) from error

    def _migrate(self) -> None:
        with self._conn():
            pass

    def _migrate_on(self, conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            # One replica migrates; the others wait here and then find nothing to do.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_MIGRATE_KEY,))
            conn.execute("CREATE TABLE IF NOT EXISTS mlxcel_schema (version INTEGER NOT NULL)")
            row = conn.execute("SELECT version FROM mlxcel_schema").fetchone()
            version = row[0] if row else 0
            if version > SCHEMA_VERSION:
                raise psycopg.OperationalError(
                    f"the store's schema is version {version}, newer than this server's "
                    f"{SCHEMA_VERSION}: upgrade mlxcel"
                )
            for step in _MIGRATIONS[version:]:
                conn.execute(step)
            if row is None:
                conn.execute("INSERT INTO mlxcel_schema VALUES (%s)", (SCHEMA_VERSION,))
            elif version < SCHEMA_VERSION:
                conn.execute("UPDATE mlxcel_schema SET version = %s", (SCHEMA_VERSION,))
        self._migrated = True

    # --- reads and writes (same contract as SessionDB) -------------------------------------

    def get(self, table: Table, key: str) -> dict[str, Any] | None:
        with self._conn() as conn:
            row = conn.execute(
                f"SELECT written, body FROM mlxcel_{table} WHERE id = %s", (key,)
            ).fetchone()
            if row is None:
                return None
            ttl = self.limits[table].ttl_secs
            if ttl and self._clock() - row[0] > ttl:
                conn.execute(f"DELETE FROM mlxcel_{table} WHERE id = %s", (key,))
                return None
            body: dict[str, Any] = json.loads(row[1])
            return body

    def put(self, table: Table, key: str, body: dict[str, Any]) -> bool:
        limits = self.limits[table]
        if not limits.enabled:
            return False
        text = _text(body)
        nbytes = len(text.encode())
        if limits.max_bytes and nbytes > limits.max_bytes:
            log.warning("%s %s (%d bytes) exceeds the store's byte bound", table, key, nbytes)
            return False
        now = self._clock()
        with self._conn() as conn, conn.transaction():
            # Writers of one table take turns, so the bounds hold across replicas.
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (_TABLE_KEY[table],))
            conn.execute(
                f"INSERT INTO mlxcel_{table} (id, written, nbytes, body) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET written = EXCLUDED.written, "
                "nbytes = EXCLUDED.nbytes, body = EXCLUDED.body",
                (key, now, nbytes, text),
            )
            if limits.ttl_secs:
                conn.execute(
                    f"DELETE FROM mlxcel_{table} WHERE written < %s AND id != %s",
                    (now - limits.ttl_secs, key),
                )
            # Keep the newest rows while they fit next to the new one; the rest go, oldest
            # first (the same rows SessionDB's eviction loop removes).
            conn.execute(
                f"""DELETE FROM mlxcel_{table} WHERE id IN (
                    SELECT id FROM (
                        SELECT id, COUNT(*) OVER w AS n, SUM(nbytes) OVER w AS b
                        FROM mlxcel_{table} WHERE id != %(key)s
                        WINDOW w AS (ORDER BY written DESC, id DESC ROWS UNBOUNDED PRECEDING)
                    ) newer
                    WHERE n + 1 > %(max_entries)s
                       OR (%(max_bytes)s > 0 AND b + %(nbytes)s > %(max_bytes)s))""",
                {
                    "key": key,
                    "max_entries": limits.max_entries,
                    "max_bytes": limits.max_bytes,
                    "nbytes": nbytes,
                },
            )
        return True

    def delete(self, table: Table, key: str) -> bool:
        with self._conn() as conn:
            cur = conn.execute(f"DELETE FROM mlxcel_{table} WHERE id = %s", (key,))
            return cur.rowcount > 0

    def count(self, table: Table) -> tuple[int, int]:
        with self._conn() as conn:
            row = conn.execute(
                f"SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM mlxcel_{table}"
            ).fetchone()
            assert row is not None
            return int(row[0]), int(row[1])

    # --- the cluster: running responses, cancel, sweeping ----------------------------------

    def mark_running(self, key: str, body: dict[str, Any]) -> None:
        """List a response this replica is generating, so other replicas can show and cancel
        it. Without a live listener nobody could reach it: then it is not listed."""
        if not self._owner_ready.wait(timeout=CONNECT_TIMEOUT) or self.owner is None:
            return
        with self._conn() as conn:
            conn.execute(
                "INSERT INTO mlxcel_running (id, owner, started, body) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (id) DO UPDATE SET owner = EXCLUDED.owner, body = EXCLUDED.body",
                (key, self.owner, self._clock(), _text(body)),
            )

    def unmark_running(self, key: str) -> None:
        with self._conn() as conn:
            conn.execute("DELETE FROM mlxcel_running WHERE id = %s", (key,))

    def running_body(self, key: str) -> dict[str, Any] | None:
        """The response as it started, when some live replica is generating it now."""
        with self._conn() as conn:
            row = conn.execute(
                "SELECT body FROM mlxcel_running WHERE id = %s AND owner IN "
                "(SELECT pid FROM pg_stat_activity)",
                (key,),
            ).fetchone()
            return json.loads(row[0]) if row else None

    def notify_cancel(self, key: str) -> None:
        with self._conn() as conn:
            conn.execute("SELECT pg_notify(%s, %s)", (CHANNEL, key))

    def sweep(self) -> bool:
        """Delete expired rows and rows of dead replicas, if no other replica is sweeping now;
        True when this one swept."""
        now = self._clock()
        with self._conn() as conn, conn.transaction():
            row = conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (_SWEEP_KEY,)).fetchone()
            if not row or not row[0]:
                return False
            for table in TABLES:
                if ttl := self.limits[table].ttl_secs:
                    conn.execute(f"DELETE FROM mlxcel_{table} WHERE written < %s", (now - ttl,))
            conn.execute(
                "DELETE FROM mlxcel_running WHERE owner NOT IN (SELECT pid FROM pg_stat_activity)"
            )
        return True

    # --- the listener thread ---------------------------------------------------------------

    def _listen(self) -> None:
        """LISTEN on its own connection for the life of the store; reconnects after a loss.
        Its backend pid names this replica in ``mlxcel_running``."""
        while not self._stop.is_set():
            try:
                with psycopg.connect(
                    self.url, autocommit=True, connect_timeout=int(CONNECT_TIMEOUT)
                ) as conn:
                    conn.execute(f"LISTEN {CHANNEL}")
                    self.owner = conn.info.backend_pid
                    self._owner_ready.set()
                    while not self._stop.is_set():
                        for note in conn.notifies(timeout=0.5):
                            if self._on_cancel is not None:
                                self._on_cancel(note.payload)
            except psycopg.Error as error:
                if self.owner is not None:
                    log.warning("session store listener lost its connection: %s", error)
                self.owner = None
                self._owner_ready.set()  # nobody waits on a listener that cannot connect
                self._stop.wait(1.0)
