"""How `mlxcel serve` reads API keys and CORS flags (llama-server's rules): CSV quoting, no
trimming, a key file's CR kept, and key sources that give no key stop the server."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mlxcel.cli import add_serve_flags, api_keys, settings_from


def parse(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_serve_flags(p)
    return p.parse_args(list(argv))


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (
        "LLAMA_API_KEY",
        "LLAMA_ARG_API_KEY_FILE",
        "LLAMA_ARG_CORS_ORIGINS",
        "LLAMA_ARG_THINK",
    ):
        monkeypatch.delenv(name, raising=False)


def test_keys_are_csv_lists_taken_exactly_as_given() -> None:
    keys = api_keys(parse("--api-key", 'k1, k2,"a,b"', "--api-key", "k3"))
    assert keys == {"k1", " k2", "a,b", "k3"}


def test_the_environment_adds_to_the_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_API_KEY", "env1,env2")
    assert api_keys(parse("--api-key", "k1")) == {"k1", "env1", "env2"}


def test_a_key_file_keeps_each_line_whole(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    f = tmp_path / "keys"
    f.write_bytes(b"# a comment\nplain\n  spaced\r\n #not a comment\n\n")
    keys = api_keys(parse("--api-key-file", str(f)))
    assert keys == {"plain", "  spaced\r", " #not a comment"}
    assert "CRLF" in caplog.text


@pytest.mark.parametrize("argv", [("--api-key", ","), ("--api-key", "")])
def test_key_flags_that_give_no_key_stop_the_server(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit, match="gave no key"):
        api_keys(parse(*argv))


def test_a_key_file_of_comments_stops_the_server(tmp_path: Path) -> None:
    f = tmp_path / "keys"
    f.write_text("# only comments\n\n")
    with pytest.raises(SystemExit, match="gave no key"):
        api_keys(parse("--api-key-file", str(f)))


def test_no_key_source_means_no_authentication() -> None:
    assert api_keys(parse()) == frozenset()


def test_cors_defaults_and_flags() -> None:
    s = settings_from(parse())
    assert s.cors_origins == ("*",) and s.cors_credentials is True
    assert s.cors_headers == "*" and s.cors_methods == "GET, POST, DELETE, OPTIONS"
    s = settings_from(parse("--allowed-origins", "http://a.test, http://b.test"))
    assert s.cors_origins == ("http://a.test", "http://b.test")
    s = settings_from(parse("--no-cors-credentials", "--cors-headers", "X-A"))
    assert s.cors_credentials is False and s.cors_headers == "X-A"
    with pytest.raises(SystemExit, match="cannot be combined"):
        settings_from(parse("--cors-origins", "*", "--allowed-origins", "http://a.test"))


def test_reasoning_format_from_the_environment_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLAMA_ARG_THINK", "none")
    assert settings_from(parse()).reasoning_format == "none"
    monkeypatch.setenv("LLAMA_ARG_THINK", "deepseek-legacy")
    with pytest.raises(SystemExit, match="--reasoning-format"):
        settings_from(parse())
