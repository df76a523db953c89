"""llama-server launch lines: llama.cpp's short forms, and the GGML flags MLX decides itself."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from mlxcel.cli import add_serve_flags, settings_from
from mlxcel.cli_compat import rewrite
from mlxcel.runtime.settings import Settings


def settings(*argv: str) -> Settings:
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_serve_flags(p)
    return settings_from(p.parse_args(rewrite(argv)))


def test_short_forms_are_rewritten_and_nothing_else() -> None:
    assert rewrite(["-ngl", "99", "-fa=on", "-c", "512", "-m", "-ngl"]) == [
        "--n-gpu-layers",
        "99",
        "--flash-attn=on",
        "-c",
        "512",
        "-m",
        "--n-gpu-layers",
    ]


def test_a_typical_llama_server_line_starts() -> None:
    s = settings("-ngl", "99", "-fa", "on", "--jinja", "-ctk", "f16", "-ctv", "f16", "-cb")
    assert s.timeout == 600.0
    s = settings("-t", "3", "-b", "256", "-ub", "128", "--no-mmap")
    # -t is the thread count (it was read as an abbreviation of -to, the HTTP timeout).
    assert s.threads == 3 and s.timeout == 600.0
    assert s.prefill_chunk_size == 256


@pytest.mark.parametrize(
    ("argv", "reason"),
    [
        (("-ctk", "q8_0"), "not quantised"),
        (("-nocb",), "always batched"),
        (("--no-jinja",), "Jinja"),
        (("--mlock",), "nothing to lock"),
        (("-tb", "2"), "one thread count"),
    ],
)
def test_flags_asking_for_what_mlx_does_not_do_stop_the_server(
    argv: tuple[str, ...], reason: str
) -> None:
    with pytest.raises(SystemExit, match=reason):
        settings(*argv)


def test_abbreviations_are_not_guessed() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_serve_flags(p)
    with pytest.raises(SystemExit):
        p.parse_args(["--embedding-mod", "x"])


def test_chat_template_flags(tmp_path: Path) -> None:
    assert settings().chat_template is None
    assert "<|im_start|>" in (settings("--chat-template", "chatml").chat_template or "")
    jinja = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
    assert settings("--chat-template", jinja).chat_template == jinja
    f = tmp_path / "t.jinja"
    f.write_text(jinja)
    assert settings("--chat-template-file", str(f)).chat_template == jinja
    with pytest.raises(SystemExit, match="built-in name"):
        settings("--chat-template", "vicuna-orca")
    with pytest.raises(SystemExit, match="exclusive"):
        settings("--chat-template", "chatml", "--chat-template-file", str(f))


def test_speculation_flags_as_llama_server_spells_them() -> None:
    default = settings()
    assert default.spec_kind == "ngram" and default.spec_max == 16
    assert settings("--no-spec-ngram").spec_kind is None
    assert settings("--spec-ngram-max", "4").spec_max == 4
    drafted = settings("-md", "/models/small", "--draft", "8", "--draft-min", "2")
    assert drafted.spec_kind == "draft" and drafted.model_draft == "/models/small"
    assert (drafted.spec_max, drafted.draft_min, drafted.draft_p_min) == (8, 2, 0.75)
    assert settings("--draft-model", "x", "--spec-draft-n-max", "5").spec_max == 5
    assert settings("--model-draft", "x", "--draft-p-min", "0.5").draft_p_min == 0.5
    # Modes that keep rows to one token a step turn it off.
    assert settings("--batch-invariant").spec_kind is None
    assert settings("--context-shift", "-md", "x").spec_kind is None


@pytest.mark.parametrize(
    "argv",
    [("--spec-ngram-max", "-1"), ("--draft-max", "-2"), ("--draft-p-min", "1.5")],
)
def test_speculation_flags_out_of_range_stop_the_server(argv: tuple[str, ...]) -> None:
    with pytest.raises(SystemExit, match=argv[0]):
        settings(*argv)


@pytest.mark.parametrize(
    ("argv", "env", "webui"),
    [
        ((), {}, True),
        (("--no-webui",), {}, False),
        (("--no-ui",), {}, False),  # llama-server's newer spelling
        ((), {"LLAMA_ARG_UI": "0"}, False),
        ((), {"LLAMA_ARG_WEBUI": "false"}, False),
        (("--webui",), {"LLAMA_ARG_UI": "0"}, True),
    ],
)
def test_the_chat_page_is_on_unless_turned_off(
    argv: tuple[str, ...], env: dict[str, str], webui: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("LLAMA_ARG_UI", "LLAMA_ARG_WEBUI"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    p = argparse.ArgumentParser(allow_abbrev=False)
    add_serve_flags(p)
    assert p.parse_args(rewrite(argv)).webui is webui
