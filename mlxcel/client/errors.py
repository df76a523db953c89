"""The client's exceptions.

    MlxcelError                 the client was misused or closed (bad arguments, ambiguous mode)
    └── MlxcelServerError       the managed server could not be started or has died; ``.stderr``
        │                       holds the last lines it wrote
        └── MlxcelTimeoutError  it did not become healthy within ``startup_timeout``

HTTP errors from a running server are not wrapped: they surface as the openai SDK's own
exceptions (``openai.AuthenticationError`` for 401, ``openai.BadRequestError`` for 400,
``openai.APIStatusError`` with ``status_code == 503`` when the admission queue is full,
``openai.APIConnectionError`` when the server cannot be reached).
"""

from __future__ import annotations

__all__ = ["MlxcelError", "MlxcelServerError", "MlxcelTimeoutError"]


class MlxcelError(Exception):
    """Base class of every exception the client raises itself."""


class MlxcelServerError(MlxcelError):
    """The managed server failed to start or exited; ``stderr`` is its output tail."""

    def __init__(self, message: str, *, stderr: str = "") -> None:
        super().__init__(
            f"{message}\n--- server output (last lines) ---\n{stderr}" if stderr else message
        )
        self.stderr = stderr


class MlxcelTimeoutError(MlxcelServerError):
    """The managed server was not healthy before ``startup_timeout``; it has been killed."""
