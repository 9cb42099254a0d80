"""A server-sent event stream written with the HTTP server's own ASGI `send`.

Starlette hands a response a `send` wrapped by each middleware, and its StreamingResponse
watches for a disconnect through an anyio task group. A streamed token is one chunk to each
client, so those layers ran once per token per client: at 64 clients they were a fifth of the
tokenizer's CPU. This response takes the server's `send`, saved in the scope by `raw_send_app`
before Starlette runs, and watches the disconnect with one plain task."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator

import structlog
from starlette.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

RAW_SEND = "mas.raw_send"  # the scope key of the server's own send


def raw_send_app(app: ASGIApp) -> ASGIApp:
    """`app`, with the server's send kept in each HTTP request's scope."""
    async def outer(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope[RAW_SEND] = send
        await app(scope, receive, send)
    return outer


class EventStream(Response):
    """text/event-stream from an async iterator of encoded events. When the client goes, the
    iterator is cancelled (its `finally` frees what the request held). The iterator turns its
    own failures into an error event (http._stream); a failure here is the transport's."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes]):
        self.events = events
        self.status_code = 200
        self.background = None
        self.init_headers(None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        send = scope.get(RAW_SEND, send)
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        writer = asyncio.ensure_future(self._write(send))
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            await asyncio.wait((writer, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (writer, gone):
                task.cancel()
            failed, _ = await asyncio.gather(writer, gone, return_exceptions=True)
            # Cancelled between two events (in `send`), the iterator would run its `finally`
            # only when collected.
            if (close := getattr(self.events, "aclose", None)) is not None:
                await close()
        if isinstance(failed, Exception):
            structlog.get_logger().warning("http.stream_failed", error=repr(failed)[:300])

    async def _write(self, send: Send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def disconnected(receive: Receive) -> None:
    """Returns when the client has gone: once a request's body is read, the next ASGI message
    is http.disconnect, so waiting for it costs nothing (polling for it did)."""
    while (await receive())["type"] != "http.disconnect":
        pass
