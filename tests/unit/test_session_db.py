"""The session store's databases: limits and TTL on both SQLite and PostgreSQL (a real one on
loopback); SQLite's restart and a writer killed mid-write; and the actor's registry of running
responses, which a cancel reaches by message. PostgreSQL's own parts: test_session_pg.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
import trio
import trio.testing

from mlxcel.actors.session_db import Limits, SessionDB, Table
from mlxcel.actors.session_pg import PgSessionDB
from mlxcel.actors.session_store import Running, SessionStore
from mlxcel.runtime.slot import AbortBox, OutputSlot, Reservation

REPO = Path(__file__).resolve().parents[2]


def limits(**responses: float) -> dict[Table, Limits]:
    return {
        "responses": Limits(**{"max_entries": 1024, **responses}),  # type: ignore[arg-type]
        "conversations": Limits(max_entries=8),
    }


Opener = Callable[..., SessionDB | PgSessionDB]


def empty_postgres(url: str) -> str:
    """The store's tables emptied (the schema stays), for a test that starts from nothing."""
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass('mlxcel_responses')").fetchone()
        if exists and exists[0]:
            conn.execute("TRUNCATE mlxcel_responses, mlxcel_conversations, mlxcel_running")
    return url


@pytest.fixture(params=["sqlite", "postgresql"])
def open_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Opener]:
    """Opens the backend under test with the given limits (and clock); closes it after."""
    opened: list[SessionDB | PgSessionDB] = []

    def open_one(lim: dict[Table, Limits], **kw: Any) -> SessionDB | PgSessionDB:
        if request.param == "sqlite":
            db: SessionDB | PgSessionDB = SessionDB(tmp_path / "s.sqlite3", lim, **kw)
        else:
            url = empty_postgres(request.getfixturevalue("postgres").url)
            db = PgSessionDB(url, lim, **kw)
        opened.append(db)
        return db

    yield open_one
    for db in opened:
        db.close()


def test_entry_bound_evicts_the_oldest(open_db: Opener) -> None:
    db = open_db(limits(max_entries=3))
    for i in range(5):
        assert db.put("responses", f"r{i}", {"n": i})
    assert [db.get("responses", f"r{i}") for i in range(5)] == [
        None,
        None,
        {"n": 2},
        {"n": 3},
        {"n": 4},
    ]
    assert db.count("responses")[0] == 3
    # The other table has its own bound.
    assert db.put("conversations", "c", {"items": []})
    assert db.count("responses")[0] == 3


def test_byte_bound_evicts_until_the_total_fits(open_db: Opener) -> None:
    db = open_db(limits(max_bytes=100))
    body = {"text": "x" * 30}  # 41 bytes of JSON
    for i in range(4):
        db.put("responses", f"r{i}", body)
    n, total = db.count("responses")
    assert n == 2 and total <= 100
    assert db.get("responses", "r3") == body and db.get("responses", "r0") is None
    # A body larger than the whole bound is refused, and evicts nothing.
    assert not db.put("responses", "big", {"text": "y" * 200})
    assert db.get("responses", "big") is None and db.count("responses")[0] == 2


def test_ttl_with_a_fake_clock(open_db: Opener) -> None:
    now = [1000.0]
    db = open_db(limits(ttl_secs=60), clock=lambda: now[0])
    db.put("responses", "old", {"n": 1})
    now[0] += 30
    db.put("responses", "young", {"n": 2})
    now[0] += 31  # "old" is 61 s old, "young" 31 s
    assert db.get("responses", "old") is None
    assert db.get("responses", "young") == {"n": 2}
    now[0] += 30
    db.put("responses", "new", {"n": 3})  # a write sweeps expired rows
    assert db.count("responses")[0] == 1


def test_zero_entries_stores_nothing(open_db: Opener) -> None:
    db = open_db(limits(max_entries=0))
    assert not db.put("responses", "r", {"n": 1})
    assert db.get("responses", "r") is None


def test_rows_survive_a_restart_and_delete_is_durable(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    db = SessionDB(path, limits())
    db.put("responses", "keep", {"a": [1, 2]})
    db.put("responses", "drop", {"b": 1})
    assert db.delete("responses", "drop") and not db.delete("responses", "drop")
    db.close()
    again = SessionDB(path, limits())
    assert again.get("responses", "keep") == {"a": [1, 2]}
    assert again.get("responses", "drop") is None


def test_an_unreadable_file_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    path.write_bytes(b"this is not a database" * 100)
    db = SessionDB(path, limits())
    assert db.put("responses", "r", {"n": 1}) and db.get("responses", "r") == {"n": 1}
    assert any(p.name.startswith("s.sqlite3.corrupt-") for p in tmp_path.iterdir())


WRITER = """
import sys
from mlxcel.actors.session_db import Limits, SessionDB
db = SessionDB(sys.argv[1], {"responses": Limits(max_entries=100),
                             "conversations": Limits(max_entries=1)})
i = 0
while True:
    db.put("responses", f"r{i}", {"i": i, "pad": "z" * 2000})
    i += 1
    if i == 150:  # past the bound of 100: every write now evicts too
        print("evicting", flush=True)
"""


def test_a_writer_killed_mid_write_leaves_a_consistent_store(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite3"
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)],
            cwd=REPO,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "evicting"
        os.kill(proc.pid, signal.SIGKILL)  # mid-loop: it writes on without a pause
        proc.wait()
        proc.stdout.close()
        db = SessionDB(path, limits())
        n, _ = db.count("responses")
        assert 50 <= n <= 100  # the bound held through every committed write
        (latest,) = db._db.execute(
            "SELECT id FROM responses ORDER BY written DESC, rowid DESC LIMIT 1"
        ).fetchone()
        body = db.get("responses", latest)
        assert body is not None and body["pad"] == "z" * 2000
        assert db._db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        db.close()


async def test_the_actor_serves_calls_from_its_own_thread(tmp_path: Path) -> None:
    store = SessionStore(tmp_path / "s.sqlite3", limits())
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        assert await store.put("responses", "r", {"n": 1})
        assert await store.get("responses", "r") == {"n": 1}
        threads = await store.call(lambda db: __import__("threading").current_thread().name)
        assert threads == "session-store"
        assert await store.delete("responses", "r")
        nursery.cancel_scope.cancel()
    # The thread closed the database on the way out; a new actor reads the same file.
    again = SessionStore(tmp_path / "s.sqlite3", limits())
    async with trio.open_nursery() as nursery:
        await nursery.start(again.run)
        assert await again.get("responses", "r") is None
        nursery.cancel_scope.cancel()


async def test_an_unwritable_location_falls_back_to_memory(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    store = SessionStore(blocker / "sub" / "s.sqlite3", limits())
    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        assert store.path == ":memory:"
        assert await store.put("responses", "r", {"n": 1})
        assert await store.get("responses", "r") == {"n": 1}
        nursery.cancel_scope.cancel()


async def test_cancelling_a_running_response_is_a_message_its_owner_finishes() -> None:
    """/cancel asks the store, which owns the running responses: it stops the generation,
    waits for the response's handler to end it, and answers with the response as it ended.
    A canceller that stops waiting changes nothing: the cancel it sent still happens."""
    store = SessionStore(":memory:", limits())
    slot = OutputSlot("resp_a", Reservation(None, None), AbortBox())
    status = ["in_progress"]
    running = Running(lambda: {"id": "resp_a", "status": status[0]}, slot)
    answers: list[dict[str, Any] | None] = []

    async def cancel() -> None:
        answers.append(await store.cancel_running("resp_a"))

    async with trio.open_nursery() as nursery:
        await nursery.start(store.run)
        assert await store.cancel_running("resp_a") is None  # nothing runs under that id
        store.begin_running("resp_a", running)
        assert store.running_snapshot("resp_a") == {"id": "resp_a", "status": "in_progress"}
        with trio.CancelScope() as leaving:
            async with trio.open_nursery() as canceller:
                canceller.start_soon(cancel)
                await trio.testing.wait_all_tasks_blocked()
                leaving.cancel()
        assert running.cancel_requested and slot.cancelled
        nursery.start_soon(cancel)
        await trio.testing.wait_all_tasks_blocked()
        assert answers == []  # the store waits for the response's own handler to end it
        status[0] = "cancelled"
        running.done.set()
        store.end_running("resp_a")
        await trio.testing.wait_all_tasks_blocked()
        assert answers == [{"id": "resp_a", "status": "cancelled"}]
        assert store.running_ids() == () and store.running_snapshot("resp_a") is None
        nursery.cancel_scope.cancel()


def test_the_store_flag_picks_the_backend(tmp_path: Path) -> None:
    import argparse

    from mlxcel.actors.session_store import open_session_store
    from mlxcel.cli import add_serve_flags, settings_from
    from mlxcel.runtime.settings import Settings

    default = open_session_store(Settings(cache_dir=tmp_path))
    assert default.path == tmp_path / "sessions.sqlite3" and not default.shared
    a_file = open_session_store(Settings(cache_dir=tmp_path, store=str(tmp_path / "x.db")))
    assert a_file.path == tmp_path / "x.db" and not a_file.shared
    url = "postgresql://u:p@db:5432/mlxcel"
    assert open_session_store(Settings(cache_dir=tmp_path, store=url)).shared
    # Both stores off: nothing is written anywhere, PostgreSQL included.
    off = Settings(
        cache_dir=tmp_path, store=url, responses_store_max_entries=0,
        conversation_store_max_entries=0,
    )  # fmt: skip
    assert open_session_store(off).path == ":memory:"
    parser = argparse.ArgumentParser()
    add_serve_flags(parser)
    assert settings_from(parser.parse_args(["--store", url])).store == url
