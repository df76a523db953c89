"""The one place that touches mlx-lm's internals: it refuses an mlx-lm it was not tested with,
its range is pyproject's pin, installing it again changes nothing, and it lists every private
method our subclasses override."""

from __future__ import annotations

import logging
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.generate import BatchGenerator, GenerationBatch
from mlx_lm.models import activations, base
from mlx_lm.models.cache import BatchKVCache

from mlxcel.actors.model_runner import eager_start
from mlxcel.models import fast_lm, mlx_lm_compat
from mlxcel.models.errors import IncompatibleMlxLm, ModelError

REPO = Path(__file__).resolve().parents[2]


def test_the_tested_range_is_pyprojects_pin() -> None:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if re.match(r"mlx-lm\b", d)]
    first, below = mlx_lm_compat.TESTED
    assert pin == f"mlx-lm>={first},<{below}"


def test_the_installed_mlx_lm_is_in_range() -> None:
    mlx_lm_compat.check_version()  # what this suite tests is what it passes


@pytest.mark.parametrize("version", ["0.32.2", "0.32.9", "0.32.10.dev1"])
def test_versions_in_range_pass(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mlx_lm_compat.UNTESTED_ENV, raising=False)
    mlx_lm_compat.check_version(version)


@pytest.mark.parametrize("version", ["0.32.1", "0.33.0", "0.33.0rc1", "1.0", "0.4.0"])
def test_versions_outside_are_a_clear_error(version: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mlx_lm_compat.UNTESTED_ENV, raising=False)
    with pytest.raises(IncompatibleMlxLm) as raised:
        mlx_lm_compat.check_version(version)
    # A ModelError: the CLI prints its message, with no traceback, and exits 1.
    assert isinstance(raised.value, ModelError)
    message = str(raised.value)
    assert f"mlx-lm {version} is installed" in message
    assert ">=0.32.2,<0.33" in message
    assert mlx_lm_compat.UNTESTED_ENV in message


def test_the_escape_hatch_warns_instead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(mlx_lm_compat.UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger=mlx_lm_compat.__name__):
        mlx_lm_compat.check_version("0.40.0")
    assert "mlx-lm 0.40.0 is installed" in caplog.text


def test_install_checks_the_version_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(mlx_lm_compat.UNTESTED_ENV, raising=False)
    monkeypatch.setattr(mlx_lm_compat, "_installed", False)
    monkeypatch.setattr(mlx_lm_compat, "installed_version", lambda: "0.33.1")
    with pytest.raises(IncompatibleMlxLm):
        mlx_lm_compat.install()
    assert mlx_lm_compat._installed is False


def test_install_twice_is_harmless(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mlx_lm_compat, "_installed", False)
    mlx_lm_compat.install()
    mlx_lm_compat.install()
    assert BatchKVCache.extend is mlx_lm_compat._extend
    # The patch falls back to mlx-lm's own method, never to itself.
    original = mlx_lm_compat._ORIGINAL_EXTEND
    assert original is not mlx_lm_compat._extend
    assert original.__module__ == "mlx_lm.models.cache"


def test_a_generator_without_the_internals_we_use_fails_at_start(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(mlx_lm_compat, "_checked_generator", False)

    class Renamed:  # as if mlx-lm had renamed its queues
        _generation_batch = GenerationBatch.empty(None, None)
        _prompt_batch = _currently_processing = None

    with pytest.raises(IncompatibleMlxLm, match="_unprocessed_sequences, .*_find_uids"):
        mlx_lm_compat.check_generator(Renamed())
    assert mlx_lm_compat._checked_generator is False


class _Module:
    """Just enough of a model for swap_model_functions: its classes' module."""

    def __init__(self, module: str) -> None:
        self.cls = type("M", (), {"__module__": module})

    def named_modules(self) -> list[tuple[str, Any]]:
        return [("", self.cls())]


def test_swapping_a_models_functions_twice_changes_nothing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from mlx_lm.models import llama

    monkeypatch.setattr(llama, "scaled_dot_product_attention", base.scaled_dot_product_attention)
    monkeypatch.setattr(llama, "swiglu", activations.swiglu)
    wraps = {"scaled_dot_product_attention": fast_lm._lm_attention, "swiglu": fast_lm._lm_swiglu}
    model = _Module("mlx_lm.models.llama")
    first = mlx_lm_compat.swap_model_functions(model, wraps)
    assert first == [
        "mlx_lm.models.llama.scaled_dot_product_attention",
        "mlx_lm.models.llama.swiglu",
    ]
    wrapped = llama.scaled_dot_product_attention
    assert mlx_lm_compat.swap_model_functions(model, wraps) == []
    assert llama.scaled_dot_product_attention is wrapped
    assert wrapped.__wrapped__ is base.scaled_dot_product_attention
    assert llama.swiglu.__wrapped__ is activations.swiglu
    # mlx-lm's own definitions stay as they were: only the model's family module changes.
    assert not hasattr(base.scaled_dot_product_attention, "__wrapped__")
    # A module outside mlx_lm.models is never touched.
    assert mlx_lm_compat.swap_model_functions(_Module(__name__), wraps) == []


def test_every_private_override_is_listed() -> None:
    for ours, theirs in (
        (eager_start.EagerStartBatchGenerator, BatchGenerator),
        (eager_start.PrimedGenerationBatch, GenerationBatch),
    ):
        private = {
            name
            for name in vars(ours)
            if name.startswith("_") and not name.startswith("__") and hasattr(theirs, name)
        }
        assert private == set(mlx_lm_compat.OVERRIDDEN[theirs]), ours.__name__
