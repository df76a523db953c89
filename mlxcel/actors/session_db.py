"""The session store's database: stored responses and conversations in embedded SQLite.

Plain synchronous code, used only from the session-store actor's own thread (and directly by
unit tests). Every write is one transaction committed before the call returns; the journal is
WAL, so a process killed at any moment (``kill -9``) leaves the last committed state and a
reader never sees a half-written row. Both tables are bounded by entry count, total bytes and
age (TTL): the oldest rows go first. A file that SQLite cannot read is moved aside and a fresh
one started, so a damaged store costs the stored sessions, never the server.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import attrs

log = logging.getLogger(__name__)

Table = Literal["responses", "conversations"]
TABLES: tuple[Table, ...] = ("responses", "conversations")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS {table} (
    id TEXT PRIMARY KEY,
    -- wall-clock seconds of the last write: age for the TTL, order for eviction
    written REAL NOT NULL,
    nbytes INTEGER NOT NULL,
    body TEXT NOT NULL
);
-- covering: the bound checks (COUNT, SUM(nbytes)) and eviction order read only this index
CREATE INDEX IF NOT EXISTS {table}_age ON {table} (written, nbytes, id);
"""


@attrs.frozen(kw_only=True)
class Limits:
    """Bounds on one table. ``max_entries`` 0 turns the table off; ``max_bytes`` and
    ``ttl_secs`` 0 mean no bound of that kind."""

    max_entries: int
    max_bytes: int = 0
    ttl_secs: float = 0.0

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0


class SessionDB:
    # One process owns the file: running responses stay in the actor's own registry.
    shared = False

    def __init__(
        self,
        path: Path | str,
        limits: dict[Table, Limits],
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.path = Path(path) if path != ":memory:" else None
        self.limits = limits
        self._clock = clock
        self._db = self._open(path)

    # --- opening ---------------------------------------------------------------------------

    def _open(self, path: Path | str) -> sqlite3.Connection:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            return self._connect(path)
        except sqlite3.DatabaseError as error:
            if self.path is None:
                raise
            aside = self.path.with_name(f"{self.path.name}.corrupt-{int(time.time())}")
            log.error("session store %s is unreadable (%s); moved to %s", self.path, error, aside)
            for suffix in ("", "-wal", "-shm"):
                src = Path(f"{self.path}{suffix}")
                if src.exists():
                    src.rename(Path(f"{aside}{suffix}"))
            return self._connect(path)

    @staticmethod
    def _connect(path: Path | str) -> sqlite3.Connection:
        # isolation_level=None: we open each transaction ourselves (BEGIN IMMEDIATE), so a
        # write and its eviction commit together. check_same_thread stays on: one thread owns it.
        db = sqlite3.connect(str(path), isolation_level=None, timeout=30.0)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            # NORMAL in WAL mode: a committed write survives the process being killed; only a
            # power loss can drop the last transactions, never corrupt the file.
            db.execute("PRAGMA synchronous=NORMAL")
            (verdict,) = db.execute("PRAGMA quick_check").fetchone()
            if verdict != "ok":
                raise sqlite3.DatabaseError(f"quick_check: {verdict}")
            for table in TABLES:
                db.executescript(_SCHEMA.format(table=table))
        except BaseException:
            db.close()
            raise
        return db

    def close(self) -> None:
        self._db.close()

    # --- reads and writes ------------------------------------------------------------------

    def get(self, table: Table, key: str) -> dict[str, Any] | None:
        """The stored body, or None when absent or older than the TTL."""
        row = self._db.execute(f"SELECT written, body FROM {table} WHERE id = ?", (key,)).fetchone()
        if row is None:
            return None
        if self._expired(table, row[0]):
            self.delete(table, key)
            return None
        body: dict[str, Any] = json.loads(row[1])
        return body

    def put(self, table: Table, key: str, body: dict[str, Any]) -> bool:
        """Insert or replace one row, then evict down to the limits, in one transaction.

        False when the table is off or the body alone is larger than the byte bound (it is not
        stored then)."""
        limits = self.limits[table]
        if not limits.enabled:
            return False
        text = json.dumps(body, ensure_ascii=False, separators=(",", ":"))
        nbytes = len(text.encode())
        if limits.max_bytes and nbytes > limits.max_bytes:
            log.warning("%s %s (%d bytes) exceeds the store's byte bound", table, key, nbytes)
            return False
        with self._transaction():
            self._db.execute(
                f"INSERT OR REPLACE INTO {table} (id, written, nbytes, body) VALUES (?, ?, ?, ?)",
                (key, self._clock(), nbytes, text),
            )
            self._evict(table, keep=key)
        return True

    def delete(self, table: Table, key: str) -> bool:
        with self._transaction():
            cur = self._db.execute(f"DELETE FROM {table} WHERE id = ?", (key,))
        return cur.rowcount > 0

    def count(self, table: Table) -> tuple[int, int]:
        """(rows, bytes) currently held, expired rows included until the next write."""
        n, b = self._db.execute(
            f"SELECT COUNT(*), COALESCE(SUM(nbytes), 0) FROM {table}"
        ).fetchone()
        return int(n), int(b)

    # --- the cluster's calls: nothing to share with an embedded file ------------------------

    def mark_running(self, key: str, body: dict[str, Any]) -> None:
        pass

    def unmark_running(self, key: str) -> None:
        pass

    def running_body(self, key: str) -> dict[str, Any] | None:
        return None

    def notify_cancel(self, key: str) -> None:
        pass

    def sweep(self) -> bool:
        return False

    # --- internals -------------------------------------------------------------------------

    def _expired(self, table: Table, written: float) -> bool:
        ttl = self.limits[table].ttl_secs
        return bool(ttl) and self._clock() - written > ttl

    def _evict(self, table: Table, keep: str) -> None:
        limits = self.limits[table]
        if limits.ttl_secs:
            self._db.execute(
                f"DELETE FROM {table} WHERE written < ? AND id != ?",
                (self._clock() - limits.ttl_secs, keep),
            )
        n, total = self.count(table)
        if n <= limits.max_entries and (not limits.max_bytes or total <= limits.max_bytes):
            return
        # Oldest first, a small batch at a time; the row just written is never its own victim.
        while n > limits.max_entries or (limits.max_bytes and total > limits.max_bytes):
            batch = self._db.execute(
                f"SELECT id, nbytes FROM {table} WHERE id != ? ORDER BY written LIMIT 32", (keep,)
            ).fetchall()
            if not batch:
                return
            for key, nbytes in batch:
                if n <= limits.max_entries and (not limits.max_bytes or total <= limits.max_bytes):
                    return
                self._db.execute(f"DELETE FROM {table} WHERE id = ?", (key,))
                n -= 1
                total -= nbytes

    def _transaction(self) -> _Transaction:
        return _Transaction(self._db)


class _Transaction:
    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, kind: object, *_: object) -> None:
        self._db.execute("COMMIT" if kind is None else "ROLLBACK")
