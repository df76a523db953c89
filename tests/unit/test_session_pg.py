"""The PostgreSQL session store's own parts, against a real PostgreSQL on loopback: rows shared
between replicas, the schema version, TTL swept by one replica at a time, cancel by NOTIFY, a
dead replica's running entries, and a database that goes down and comes back (503s, then
service again). The bounds and TTL it shares with SQLite: test_session_db.py, on both."""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import pytest

from mlxcel.actors.session_pg import _SWEEP_KEY, SCHEMA_VERSION, PgSessionDB
from mlxcel.runtime.errors import StoreUnavailable
from tests.support.postgres import PostgresServer
from tests.unit.test_session_db import empty_postgres, limits


@pytest.fixture
def url(postgres: PostgresServer) -> str:
    return empty_postgres(postgres.url)


def test_rows_are_shared_and_the_schema_is_versioned(url: str) -> None:
    a, b = PgSessionDB(url, limits()), PgSessionDB(url, limits())
    try:
        a.put("responses", "r", {"n": 1, "text": "é"})
        assert b.get("responses", "r") == {"n": 1, "text": "é"}
        assert b.delete("responses", "r") and not a.delete("responses", "r")
        assert a.get("responses", "r") is None
        with psycopg.connect(url) as conn:
            rows = conn.execute("SELECT version FROM mlxcel_schema").fetchall()
            assert rows == [(SCHEMA_VERSION,)]
    finally:
        a.close()
        b.close()


def test_one_replica_sweeps_expired_rows_at_a_time(url: str) -> None:
    now = [1000.0]
    db = PgSessionDB(url, limits(ttl_secs=10), clock=lambda: now[0])
    try:
        db.put("responses", "old", {"n": 1})
        now[0] += 20
        assert db.count("responses")[0] == 1  # expired, not yet swept
        # While another replica holds the sweep lock, this one skips its turn.
        with psycopg.connect(url, autocommit=True) as other, other.transaction():
            other.execute("SELECT pg_advisory_xact_lock(%s)", (_SWEEP_KEY,))
            assert not db.sweep()
            assert db.count("responses")[0] == 1
        assert db.sweep()
        assert db.count("responses")[0] == 0
    finally:
        db.close()


def test_a_cancel_reaches_the_replica_that_runs_it(url: str) -> None:
    heard: list[str] = []
    got = threading.Event()

    def on_cancel(rid: str) -> None:
        heard.append(rid)
        got.set()

    runner, other = PgSessionDB(url, limits(), on_cancel=on_cancel), PgSessionDB(url, limits())
    try:
        body: dict[str, Any] = {"id": "resp_1", "status": "in_progress"}
        runner.mark_running("resp_1", body)
        assert other.running_body("resp_1") == body
        other.notify_cancel("resp_1")
        assert got.wait(5) and heard == ["resp_1"]
        runner.unmark_running("resp_1")
        assert other.running_body("resp_1") is None
    finally:
        runner.close()
        other.close()


def test_a_dead_replicas_running_entries_are_swept(url: str) -> None:
    dead, alive = PgSessionDB(url, limits()), PgSessionDB(url, limits())
    try:
        dead.mark_running("resp_2", {"id": "resp_2"})
        assert alive.running_body("resp_2") is not None
    finally:
        dead.close()  # its listener connection ends, as when its process is killed
    try:
        deadline = time.monotonic() + 5
        while alive.running_body("resp_2") is not None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert alive.sweep()
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT COUNT(*) FROM mlxcel_running").fetchone() == (0,)
    finally:
        alive.close()


def test_a_database_that_goes_down_answers_unavailable_then_recovers(
    postgres: PostgresServer, url: str
) -> None:
    db = PgSessionDB(url, limits())
    try:
        db.put("responses", "kept", {"n": 1})
        postgres.stop()
        try:
            started = time.monotonic()
            with pytest.raises(StoreUnavailable, match="PostgreSQL"):
                db.get("responses", "kept")
            assert time.monotonic() - started < 10
        finally:
            postgres.start()
        deadline = time.monotonic() + 15
        while True:
            try:
                assert db.get("responses", "kept") == {"n": 1}
                break
            except StoreUnavailable:
                assert time.monotonic() < deadline
                time.sleep(0.2)
    finally:
        db.close()
