"""``mlxcel.AsyncLLM``: the asyncio client. Same arguments as ``LLM``; methods are awaitables.

The managed server is started synchronously in the constructor (a one-time blocking wait;
build the client before the event loop is busy, or in a worker thread). The model id resolves
on the first request, or explicitly with ``await llm.resolve_model()``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from mlxcel.client._managed import start_or_connect
from mlxcel.client._sampling import build_params
from mlxcel.client._transport import async_http_client, default_timeout, resolve_api_key
from mlxcel.client.errors import MlxcelError

if TYPE_CHECKING:
    import httpx
    from openai import AsyncOpenAI, AsyncStream
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

Messages = Iterable[Mapping[str, Any]]


class AsyncLLM:
    """An asyncio client for an mlxcel server; see :class:`mlxcel.LLM` for the arguments.

    Use ``async with`` or ``await llm.close()``: the connection pool can only be closed from
    the event loop. The managed server is also stopped by the finaliser and at exit.
    Cancelling a call closes its connection, which the server takes as an abort.
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        base_url: str | None = None,
        socket: str | os.PathLike[str] | None = None,
        api_key: str | None = None,
        binary: str | os.PathLike[str] | Sequence[str] | None = None,
        host: str | None = None,
        port: int | None = None,
        ctx_size: int | None = None,
        n_predict: int | None = None,
        alias: str | None = None,
        warmup: bool | None = None,
        extra_args: Sequence[str] | None = None,
        startup_timeout: float = 600.0,
        shutdown_grace: float = 5.0,
        timeout: httpx.Timeout | float | None = None,
        max_retries: int = 2,
        model_id: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        from openai import AsyncOpenAI

        options = {
            "binary": binary,
            "host": host,
            "port": port,
            "ctx_size": ctx_size,
            "n_predict": n_predict,
            "alias": alias,
            "warmup": warmup,
            "extra_args": extra_args,
        }
        self._api_key = resolve_api_key(api_key)
        self._target, self._server = start_or_connect(
            model,
            base_url=base_url,
            socket=socket,
            transport=transport,
            api_key=self._api_key,
            startup_timeout=startup_timeout,
            shutdown_grace=shutdown_grace,
            server_options={k: v for k, v in options.items() if v is not None},
        )
        self._finalizer = weakref.finalize(self, self._server.close if self._server else _nothing)
        self._http = async_http_client(self._target, timeout or default_timeout(), transport)
        self._model = model_id
        self._client = AsyncOpenAI(
            base_url=self._target.base_url,
            api_key=self._api_key or "no-key",
            # openai>=3 annotates httpx2 clients but accepts httpx's, which 1.x/2.x require.
            http_client=cast(Any, self._http),
            max_retries=max_retries,
        )

    # -- lifecycle --------------------------------------------------------------------------

    async def close(self) -> None:
        """Close the connection pool and stop the managed server (idempotent). The server's
        shutdown blocks for up to ``shutdown_grace`` seconds."""
        await self._http.aclose()
        self._finalizer()

    async def __aenter__(self) -> AsyncLLM:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def ensure_alive(self) -> None:
        """As :meth:`mlxcel.LLM.ensure_alive`."""
        if self.closed:
            raise MlxcelError("the client is closed")
        if self._server is not None:
            self._server.ensure_alive()

    @property
    def server_pid(self) -> int | None:
        return self._server.pid if self._server is not None else None

    @property
    def socket_path(self) -> str | None:
        return self._target.uds

    @property
    def base_url(self) -> str:
        return self._target.base_url

    # -- model ------------------------------------------------------------------------------

    @property
    def openai_client(self) -> AsyncOpenAI:
        """The ``openai.AsyncOpenAI`` client this one uses: same transport, key and timeouts."""
        return self._client

    @property
    def model(self) -> str:
        """The served model id, once known (``model_id=``, or after the first request or
        ``await resolve_model()``); ``MlxcelError`` before that, since a property cannot wait."""
        if self._model is None:
            raise MlxcelError("the model id is not known yet: await llm.resolve_model() first")
        return self._model

    async def resolve_model(self) -> str:
        """The served model id: ``model_id=`` if given, else ``/v1/models``' first entry."""
        if self._model is None:
            ids = await self.models()
            if not ids:
                raise MlxcelError("the server lists no models at /v1/models")
            self._model = ids[0]
        return self._model

    async def models(self) -> list[str]:
        self.ensure_alive()
        return [m.id for m in (await self._client.models.list()).data]

    # -- generation -------------------------------------------------------------------------

    async def generate(self, prompt: str, **sampling: Any) -> str:
        params = await self._params("completion", sampling)
        reply: Completion = await self._client.completions.create(
            prompt=prompt, stream=False, **params
        )
        return reply.choices[0].text

    async def stream(self, prompt: str, **sampling: Any) -> AsyncIterator[str]:
        """Yield completion text deltas; ``aclose()`` the iterator to stop early."""
        params = await self._params("completion", sampling)
        chunks: AsyncStream[Completion] = await self._client.completions.create(
            prompt=prompt, stream=True, **params
        )
        async with chunks:
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].text:
                    yield chunk.choices[0].text

    async def chat(self, messages: Messages, **sampling: Any) -> str:
        params = await self._params("chat", sampling)
        reply: ChatCompletion = await self._client.chat.completions.create(
            messages=_messages(messages), stream=False, **params
        )
        return reply.choices[0].message.content or ""

    async def chat_stream(self, messages: Messages, **sampling: Any) -> AsyncIterator[str]:
        """Yield chat content deltas; ``aclose()`` the iterator to stop early."""
        params = await self._params("chat", sampling)
        chunks: AsyncStream[ChatCompletionChunk] = await self._client.chat.completions.create(
            messages=_messages(messages), stream=True, **params
        )
        async with chunks:
            async for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content

    # -- tokenizer --------------------------------------------------------------------------

    async def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        reply = await self._native("/tokenize", {"content": text, "add_special": add_special})
        return [int(t) for t in reply["tokens"]]

    async def detokenize(self, ids: Iterable[int]) -> str:
        return str((await self._native("/detokenize", {"tokens": list(ids)}))["content"])

    # -- internals --------------------------------------------------------------------------

    async def _params(self, endpoint: Any, sampling: dict[str, Any]) -> dict[str, Any]:
        self.ensure_alive()
        params = build_params(endpoint, sampling)
        if "model" not in params:
            params["model"] = await self.resolve_model()
        return params

    async def _native(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.ensure_alive()
        reply: Any = await self._client.post(
            f"{self._target.root}{path}", body=body, cast_to=object
        )
        if not isinstance(reply, dict):
            raise MlxcelError(f"{path} answered {reply!r}, not a JSON object")
        return reply


def _nothing() -> None:
    pass


def _messages(messages: Messages) -> list[ChatCompletionMessageParam]:
    # Plain dicts are what users write; the SDK's TypedDict union is the same shape.
    return cast("list[ChatCompletionMessageParam]", list(messages))
