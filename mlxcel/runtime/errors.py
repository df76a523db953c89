"""One exception hierarchy for the whole server.

Every error a request can meet is one of these; ``mlxcel.http.errors`` maps each class to a
status code and to the error envelope of the API family that was called, in one place.

    MlxcelError                      base; never raised directly
    ├── RequestError                 the request itself is at fault (4xx)
    │   ├── InvalidRequest           400: malformed JSON, wrong type, out-of-range field
    │   │   ├── UnsupportedField     400: a field we cannot honour, named
    │   │   └── ContextOverflow      400: the prompt fills the context (llama-server's type)
    │   ├── AuthenticationFailed     401
    │   ├── FeatureDisabled          403: a llama-server feature this server never offers
    │   ├── NotFound                 404: unknown model or route object
    │   └── PayloadTooLarge          413
    ├── ServiceError                 the server cannot serve it now (5xx)
    │   ├── ServerBusy               503: admission queue full (before any SSE byte)
    │   ├── Unavailable              503: model loading
    │   │   ├── ShuttingDown         503: draining after SIGTERM (with Retry-After)
    │   │   └── StoreUnavailable     503: the shared session store (PostgreSQL) is unreachable
    │   ├── NotImplementedRoute      501: a route whose model kind is not loaded
    │   └── Timeout                  504
    └── InternalError                500: a bug or a failed computation
"""

from __future__ import annotations


class MlxcelError(Exception):
    """Base of every error the server reports to a client."""

    status: int = 500
    error_type: str = "server_error"
    # Seconds a client should wait before trying again (the Retry-After header), if any.
    retry_after: int | None = None

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        # The request field at fault, when there is one (OpenAI puts it in `param`).
        self.param = param


class RequestError(MlxcelError):
    status = 400
    error_type = "invalid_request_error"


class InvalidRequest(RequestError):
    pass


class UnsupportedField(InvalidRequest):
    def __init__(self, field: str, why: str = "is not supported by this server") -> None:
        super().__init__(f"Unsupported field '{field}': {why}", param=field)


class ContextOverflow(InvalidRequest):
    """llama-server's ``exceed_context_size_error``: clients read the two sizes from the
    error object to trim their history and retry."""

    error_type = "exceed_context_size_error"

    def __init__(self, n_prompt_tokens: int, n_ctx: int, *, param: str | None = None) -> None:
        super().__init__(
            f"request ({n_prompt_tokens} tokens) exceeds the available context size "
            f"({n_ctx} tokens), try increasing it",
            param=param,
        )
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx


class AuthenticationFailed(RequestError):
    status = 401
    error_type = "authentication_error"


class FeatureDisabled(RequestError):
    status = 403
    error_type = "feature_disabled"


class NotFound(RequestError):
    status = 404
    error_type = "not_found_error"


class PayloadTooLarge(RequestError):
    status = 413
    error_type = "invalid_request_error"


class ServiceError(MlxcelError):
    status = 503
    error_type = "unavailable_error"


class ServerBusy(ServiceError):
    status = 503
    error_type = "server_busy"
    # A place frees up when a request finishes: SDKs that honour Retry-After (openai,
    # anthropic) wait this long instead of their own backoff.
    retry_after = 1

    def __init__(self, message: str = "All slots are busy. Please try again later.") -> None:
        super().__init__(message)


class Unavailable(ServiceError):
    status = 503
    error_type = "unavailable_error"


class ShuttingDown(Unavailable):
    # Behind a load balancer the retry lands on another replica; /health already answers
    # 503, so this one is about to leave the rotation.
    retry_after = 1

    def __init__(self, message: str = "The server is shutting down.") -> None:
        super().__init__(message)


class StoreUnavailable(Unavailable):
    # The shared PostgreSQL store is down or unreachable: store operations answer this while
    # requests that need no store are still served.
    retry_after = 1


class NotImplementedRoute(ServiceError):
    status = 501
    error_type = "not_implemented"


class Timeout(ServiceError):
    status = 504
    error_type = "timeout_error"


class InternalError(MlxcelError):
    status = 500
    error_type = "server_error"


NO_GENERATION = (
    "This server runs without a chat model (embedding or rerank only): generation routes are "
    "not available. Start it with -m <chat model> and --embedding-model <embedder>."
)


def require_generation(generation: bool) -> None:
    """A generation route's first check: 501 ``not_implemented`` in side-model-only mode."""
    if not generation:
        raise NotImplementedRoute(NO_GENERATION)
