"""Errors raised while finding, converting or loading a model.

    ModelError
     +-- ModelNotFound      the spec names nothing we can find (or download)
     +-- UnsupportedModel   we found it but cannot convert or load it
     +-- IncompatibleMlxLm  the installed mlx-lm is outside the tested versions
     +-- AdapterError       a --lora adapter cannot be read or does not fit the model

They carry a message meant for a person, so the CLI prints ``str(exc)``
without a traceback. ``runtime/errors.py`` may wrap them; they live here so
that ``mlxcel.models`` imports nothing from the runtime.
"""

from __future__ import annotations


class ModelError(Exception):
    """Base of every error raised by ``mlxcel.models``."""


class ModelNotFound(ModelError):
    """The model spec names no folder, file, installed package or hub repo."""


class UnsupportedModel(ModelError):
    """The model exists but uses a format or architecture we do not handle."""


class IncompatibleMlxLm(ModelError):
    """The installed mlx-lm is outside the versions whose internals we rely on and test."""


class AdapterError(ModelError):
    """A --lora adapter that cannot be loaded or does not fit the model."""
