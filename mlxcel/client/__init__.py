"""The mlxcel Python client: ``LLM`` (sync) and ``AsyncLLM`` (asyncio).

Light on purpose: importing it pulls in neither mlx nor the server, and openai/httpx only
when a client is built.
"""

from mlxcel.client._async import AsyncLLM
from mlxcel.client._sync import LLM
from mlxcel.client.errors import MlxcelError, MlxcelServerError, MlxcelTimeoutError

__all__ = ["LLM", "AsyncLLM", "MlxcelError", "MlxcelServerError", "MlxcelTimeoutError"]
