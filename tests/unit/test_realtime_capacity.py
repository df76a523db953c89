"""The realtime session cap (issue 39): derived from the decode rows and the speech workers'
places when not given, and a warning at start when --realtime-max-sessions is above it."""

from __future__ import annotations

import argparse
import logging

import pytest

from mlxcel.actors.realtime.capacity import announce, derived_capacity, session_capacity
from mlxcel.cli import add_serve_flags, settings_from
from mlxcel.http.context import ServerContext
from mlxcel.runtime.metrics import Metrics
from mlxcel.runtime.settings import Settings


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(list(argv))


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MLXCEL_REALTIME_MAX_SESSIONS", "LLAMA_ARG_N_PARALLEL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("LLAMA_ARG_AUDIO_QUEUE_DEPTH", raising=False)


@pytest.mark.parametrize(
    ("parallel", "depth", "expected"),
    [(4, 8, 4), (16, 8, 8), (16, 16, 16), (8, 8, 8), (1, 8, 1), (3, 1, 1)],
)
def test_the_capacity_is_the_scarcer_of_rows_and_worker_places(
    parallel: int, depth: int, expected: int
) -> None:
    assert derived_capacity(parallel, depth) == expected


def test_without_a_cap_the_derived_capacity_is_the_cap_and_nothing_is_warned() -> None:
    c = session_capacity(None, parallel=16, audio_queue_depth=8)
    assert (c.limit, c.derived, c.explicit) == (8, 8, False)
    assert c.warning() is None


def test_a_cap_at_or_below_the_capacity_is_not_warned_about() -> None:
    for cap in (1, 4):
        c = session_capacity(cap, parallel=4, audio_queue_depth=8)
        assert (c.limit, c.derived, c.explicit) == (cap, 4, True)
        assert c.warning() is None


def test_a_cap_above_the_capacity_names_both_numbers_and_the_flags_to_raise() -> None:
    # The setup: --realtime-max-sessions 16 --parallel 16 with 8 places a worker.
    warning = session_capacity(16, parallel=16, audio_queue_depth=8).warning()
    assert warning is not None
    assert "--realtime-max-sessions 16 is above the 8 realtime sessions" in warning
    # Only what is short is named: --parallel 16 carries 16 already.
    assert "--audio-queue-depth 8" in warning and "Raise --audio-queue-depth to 16" in warning
    assert "--parallel" not in warning
    assert "lower --realtime-max-sessions to 8" in warning
    both = session_capacity(12, parallel=4, audio_queue_depth=8).warning()
    assert both is not None
    assert "Raise --parallel and --audio-queue-depth to 12" in both
    assert "--parallel 4: decode rows" in both


def test_the_warning_is_logged_at_start(caplog: pytest.LogCaptureFixture) -> None:
    log = logging.getLogger("test.realtime.capacity")
    with caplog.at_level(logging.INFO, logger=log.name):
        announce(session_capacity(16, parallel=16, audio_queue_depth=8), log)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "--realtime-max-sessions 16 is above the 8" in warnings[0].getMessage()
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["realtime voice sessions at once: 16 (--realtime-max-sessions)"]


def test_a_derived_cap_is_logged_with_its_source_and_no_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    log = logging.getLogger("test.realtime.capacity")
    with caplog.at_level(logging.INFO, logger=log.name):
        announce(session_capacity(None, parallel=4, audio_queue_depth=8), log)
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (
            logging.INFO,
            "realtime voice sessions at once: 4 (min(--parallel 4, --audio-queue-depth 8))",
        )
    ]


def test_the_flag_is_optional_and_still_checked() -> None:
    assert settings_from(parse()).realtime_max_sessions is None
    assert settings_from(parse("--realtime-max-sessions", "5")).realtime_max_sessions == 5
    with pytest.raises(SystemExit, match="--realtime-max-sessions is out of range"):
        settings_from(parse("--realtime-max-sessions", "0"))


def test_the_server_context_derives_the_cap_from_its_settings() -> None:
    def ctx(**kw: object) -> ServerContext:
        return ServerContext(settings=Settings(**kw), models=None, metrics=Metrics())  # type: ignore[arg-type]  # no model needed

    assert ctx(parallel=2, audio_queue_depth=8).realtime_capacity().limit == 2
    c = ctx(parallel=2, audio_queue_depth=8, realtime_max_sessions=6).realtime_capacity()
    assert (c.limit, c.derived) == (6, 2)
