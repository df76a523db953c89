"""mlxcel: an LLM inference server on MLX, and its Python client.

``import mlxcel`` stays light: it imports only the client (``mlxcel.LLM``, ``mlxcel.AsyncLLM``),
never mlx or the server. The server is ``mlxcel serve`` (or ``python -m mlxcel serve``).
"""

from mlxcel.client import LLM, AsyncLLM, MlxcelError, MlxcelServerError, MlxcelTimeoutError

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "AsyncLLM",
    "MlxcelError",
    "MlxcelServerError",
    "MlxcelTimeoutError",
    "__version__",
]
