"""Request bodies and HTTP/1.1 connections: every answer leaves its connection usable, or closes it.

h11 starts the next request on a keep-alive connection only once both sides have finished their
message. When the answer goes out before the request body was read (a route that takes no body,
an early error, a body over the size limit), Hypercorn closes the connection instead, from inside
the app's task, right after it tells the app that the client has gone. Quart-Trio cancels the
app's task on that news, so the close itself was cancelled: the socket stayed open, Hypercorn read
and dropped the rest of the body, and then waited forever for a request cycle that never started.
A client saw its next request on the connection go unanswered, and a body over the limit sent
chunked got its 413 but never the end of the connection.

Two parts, both for every route:

* ``Connection`` does not cancel a handler that has already sent its whole answer, so Hypercorn's
  own close (or recycle) of the connection runs to its end.
* ``settle_body`` reads what is left of the body before the answer goes out, up to the size
  limit, so the connection can serve the next request; a body it cannot read (over the limit, or
  still arriving after ``DRAIN_TIMEOUT``) makes the answer ``Connection: close``.
"""

from __future__ import annotations

import trio
from hypercorn.typing import (
    ASGIReceiveCallable,
    ASGISendCallable,
    ASGISendEvent,
)
from quart import Response, request
from quart.asgi import ASGIHTTPConnection
from quart.wrappers import Request
from quart_trio.asgi import TrioASGIHTTPConnection
from werkzeug.exceptions import RequestEntityTooLarge, RequestTimeout

# A body that is not all here this long after the answer is ready is not waited for: the answer
# closes the connection instead. Bodies the route read are complete already and cost nothing.
DRAIN_TIMEOUT = 10.0


class Connection(TrioASGIHTTPConnection):
    """Quart-Trio's HTTP connection, less the cancel that cut Hypercorn's connection close short.

    A disconnect before the answer is complete still cancels the handler: that is how a client
    that goes away aborts its generation.
    """

    _answered = False

    async def handle_messages(  # type: ignore[override]  # Quart-Trio's signature, not Quart's
        self, nursery: trio.Nursery, request: Request, receive: ASGIReceiveCallable
    ) -> None:
        await ASGIHTTPConnection.handle_messages(self, request, receive)
        # Once the whole answer is out, the disconnect comes from Hypercorn closing or recycling
        # the connection inside our last send: cancelling now would cancel that.
        if not self._answered:
            nursery.cancel_scope.cancel()

    async def handle_request(  # type: ignore[override]  # Quart-Trio's signature, not Quart's
        self, nursery: trio.Nursery, request: Request, send: ASGISendCallable
    ) -> None:
        async def send_and_note(message: ASGISendEvent) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                self._answered = True
            await send(message)

        await super().handle_request(nursery, request, send_and_note)


async def settle_body(response: Response) -> Response:
    """An ``after_request`` hook: read the rest of the request body, or close the connection.

    Cancellation (the client went away) propagates; the answer is not sent then anyway.
    """
    drained = False
    with trio.move_on_after(DRAIN_TIMEOUT):
        try:
            # cache=True: a streamed answer's generator may still look at the parsed body.
            await request.get_data()
        except (RequestEntityTooLarge, RequestTimeout):
            pass
        else:
            drained = True
    if not drained:
        response.headers["Connection"] = "close"
    return response
