"""``mlxcel.LLM``: the synchronous client, managed or connected."""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

from mlxcel.client._managed import ManagedServer, start_or_connect
from mlxcel.client._sampling import build_params
from mlxcel.client._transport import default_timeout, resolve_api_key, sync_http_client
from mlxcel.client.errors import MlxcelError

if TYPE_CHECKING:
    import httpx
    from openai import OpenAI, Stream
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk, ChatCompletionMessageParam

Messages = Iterable[Mapping[str, Any]]


def _release(http: httpx.Client, server: ManagedServer | None) -> None:
    # Must not reference the LLM: weakref.finalize runs it after the LLM is gone (and at exit).
    http.close()
    if server is not None:
        server.close()


class LLM:
    """A synchronous client for an mlxcel server.

    ``LLM("<model>")`` starts ``mlxcel serve`` for that model (managed mode) and stops it on
    ``close()``, at the end of a ``with`` block, when the object is garbage-collected, or at
    interpreter exit. ``LLM(base_url=...)`` / ``LLM(socket=...)`` connect to a running server.
    Methods raise the openai SDK's exceptions for HTTP errors and :class:`MlxcelServerError` if
    a managed server has died.
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
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        from openai import OpenAI

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
        self._http = sync_http_client(self._target, timeout or default_timeout(), transport)
        self._finalizer = weakref.finalize(self, _release, self._http, self._server)
        self._model = model_id
        self._client = OpenAI(
            base_url=self._target.base_url,
            api_key=self._api_key
            or "no-key",  # the SDK insists on one; a keyless server ignores it
            # openai>=3 annotates httpx2 clients but accepts httpx's, which 1.x/2.x require.
            http_client=cast(Any, self._http),
            max_retries=max_retries,
        )

    # -- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        """Close the connection pool and stop the managed server (idempotent)."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def ensure_alive(self) -> None:
        """Raise unless requests can be made: ``MlxcelError`` when closed, ``MlxcelServerError``
        (with the server's last output lines) when the managed server has exited."""
        if self.closed:
            raise MlxcelError("the client is closed")
        if self._server is not None:
            self._server.ensure_alive()

    @property
    def server_pid(self) -> int | None:
        """The managed server's process id (None in connect mode)."""
        return self._server.pid if self._server is not None else None

    @property
    def socket_path(self) -> str | None:
        """The Unix socket the client talks through, if any."""
        return self._target.uds

    @property
    def base_url(self) -> str:
        """The OpenAI base URL (``http://localhost/v1`` over a Unix socket)."""
        return self._target.base_url

    # -- model ------------------------------------------------------------------------------

    @property
    def openai_client(self) -> OpenAI:
        """The ``openai.OpenAI`` client this one uses: same transport, key and timeouts."""
        return self._client

    @property
    def model(self) -> str:
        """The served model id: ``model_id=`` if given, else ``/v1/models``' first entry
        (asked once, on first use)."""
        if self._model is None:
            ids = self.models()
            if not ids:
                raise MlxcelError("the server lists no models at /v1/models")
            self._model = ids[0]
        return self._model

    def models(self) -> list[str]:
        """The ids of the models the server serves."""
        self.ensure_alive()
        return [m.id for m in self._client.models.list().data]

    # -- generation -------------------------------------------------------------------------

    def generate(self, prompt: str, **sampling: Any) -> str:
        """Complete ``prompt`` (``/v1/completions``) and return the generated text."""
        params = self._params("completion", sampling)
        reply: Completion = self._client.completions.create(prompt=prompt, stream=False, **params)
        return reply.choices[0].text

    def stream(self, prompt: str, **sampling: Any) -> Iterator[str]:
        """Complete ``prompt`` and yield the text as it is generated. Closing the iterator
        early closes the connection, which the server takes as a cancellation."""
        params = self._params("completion", sampling)
        chunks: Stream[Completion] = self._client.completions.create(
            prompt=prompt, stream=True, **params
        )
        with chunks:
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].text:
                    yield chunk.choices[0].text

    def chat(self, messages: Messages, **sampling: Any) -> str:
        """Run a chat completion and return the assistant's message content."""
        params = self._params("chat", sampling)
        reply: ChatCompletion = self._client.chat.completions.create(
            messages=_messages(messages), stream=False, **params
        )
        return reply.choices[0].message.content or ""

    def chat_stream(self, messages: Messages, **sampling: Any) -> Iterator[str]:
        """Run a chat completion and yield the content deltas as they are generated."""
        params = self._params("chat", sampling)
        chunks: Stream[ChatCompletionChunk] = self._client.chat.completions.create(
            messages=_messages(messages), stream=True, **params
        )
        with chunks:
            for chunk in chunks:
                if chunk.choices and chunk.choices[0].delta.content:
                    yield chunk.choices[0].delta.content

    # -- tokenizer --------------------------------------------------------------------------

    def tokenize(self, text: str, add_special: bool = False) -> list[int]:
        """Token ids of ``text`` (native ``/tokenize``)."""
        reply = self._native("/tokenize", {"content": text, "add_special": add_special})
        return [int(t) for t in reply["tokens"]]

    def detokenize(self, ids: Iterable[int]) -> str:
        """The text of token ``ids`` (native ``/detokenize``)."""
        return str(self._native("/detokenize", {"tokens": list(ids)})["content"])

    # -- internals --------------------------------------------------------------------------

    def _params(self, endpoint: Any, sampling: dict[str, Any]) -> dict[str, Any]:
        self.ensure_alive()
        params = build_params(endpoint, sampling)
        if "model" not in params:
            params["model"] = self.model
        return params

    def _native(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.ensure_alive()
        # Through the SDK, for its auth header and its exceptions; an absolute URL leaves /v1.
        reply: Any = self._client.post(f"{self._target.root}{path}", body=body, cast_to=object)
        if not isinstance(reply, dict):
            raise MlxcelError(f"{path} answered {reply!r}, not a JSON object")
        return reply


def _messages(messages: Messages) -> list[ChatCompletionMessageParam]:
    # Plain dicts are what users write; the SDK's TypedDict union is the same shape.
    return cast("list[ChatCompletionMessageParam]", list(messages))
