"""One chat request over HTTP, for the APIs shaped around a single reply (Anthropic's
/v1/messages, OpenAI's /v1/responses): the request goes to the graph as chat completions'
does, and its replies come back through a `ReplyWriter`, the API's own view of one reply.

The writer sees the reply as the ChatOutput deltas chat completions streams (reasoning,
content, tool calls), so all three endpoints split one text the same way; it turns them into
its API's events when streamed, or its whole body when not.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable, Protocol

import structlog
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from actors.tokenizer.event_stream import EventStream, disconnected
from actors.tokenizer.intake import RequestError
from protocol import messages as m


# A streamed reply's events start once the first reply comes, or after OPEN_AFTER_S without
# one (a long prefill, a queue ahead): then the stream opens at once and a keepalive goes out
# every KEEPALIVE_S until the first token, so an agent waiting on a 20k-token prompt sees its
# reply begin instead of a silent socket. A refusal (a full queue, a prompt over the KV pool)
# comes well within OPEN_AFTER_S and stays an HTTP error.
OPEN_AFTER_S = 1.0
KEEPALIVE_S = 10.0


class ReplyWriter(Protocol):
    """An API's view of one chat reply. Streamed: begin, then text per delta, then end (or
    failed); each returns the encoded events to send; keepalive while no reply has come. Not
    streamed: whole."""

    def begin(self, prompt_tokens: int) -> list[bytes]: ...
    def keepalive(self) -> bytes: ...
    def text(self, piece: str) -> list[bytes]: ...
    def end(self, fin: m.Finished) -> list[bytes]: ...
    def failed(self, code: int, message: str) -> list[bytes]: ...
    def whole(self, fin: m.Finished) -> dict[str, Any]: ...


class Bridge(Protocol):
    def submit(self, req: m.GenerateRequest, replies: asyncio.Queue, peer: str) -> None: ...
    def abort(self, req_id: str) -> None: ...
    def prompt_tokens(self, req_id: str) -> int: ...
    def internal_error(self) -> None: ...


def peer(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else ""


async def relay(bridge: Bridge, request: Request, req: m.GenerateRequest, writer: ReplyWriter,
                done: Callable[[m.Finished], None] | None = None) -> Response:
    """Submit `req` and answer with its reply as `writer` shapes it. An error that comes
    before the stream opens (or, not streamed, at any time) is raised as RequestError (the
    route answers it in its API's shape); one later ends the stream with the writer's error
    event. `done` sees the finished reply (a response store keeps it)."""
    queue: asyncio.Queue = asyncio.Queue()
    bridge.submit(req, queue, peer(request))
    prompt_tokens = bridge.prompt_tokens(req.req_id)  # 0: refused (its error is queued)
    # Until the reply starts, a client that leaves (during a long prefill) is found by
    # waiting on its disconnect; once a stream runs, EventStream watches.
    watch = asyncio.ensure_future(_abort_when_gone(request, bridge, req.req_id))
    getter = asyncio.ensure_future(queue.get())
    try:
        await asyncio.wait({getter}, timeout=OPEN_AFTER_S if req.stream else None)
        first = getter.result() if getter.done() else None  # None: streamed, no reply yet
        if isinstance(first, m.ErrorReply):
            raise RequestError(first.message, first.code, logged=True)
        if req.stream:
            return EventStream(_events(bridge, req.req_id, queue, getter, writer,
                                       prompt_tokens, done))
        reply = first
        while not isinstance(reply, m.Finished):
            reply = await queue.get()
            if isinstance(reply, m.ErrorReply):
                raise RequestError(reply.message, reply.code, logged=True)
    except BaseException:
        getter.cancel()
        raise
    finally:
        watch.cancel()
    body = writer.whole(reply)
    if done is not None:
        done(reply)
    return JSONResponse(body)


async def _abort_when_gone(request: Request, bridge: Bridge, req_id: str) -> None:
    await disconnected(request.receive)
    bridge.abort(req_id)


async def _events(bridge: Bridge, req_id: str, queue: asyncio.Queue, first: asyncio.Future,
                  writer: ReplyWriter, prompt_tokens: int,
                  done: Callable[[m.Finished], None] | None) -> AsyncIterator[bytes]:
    """The stream: `first` is the wait for the first reply, done or not yet."""
    finished = False
    try:
        parts = writer.begin(prompt_tokens)
        while not first.done():
            yield b"".join(parts)
            parts = []
            await asyncio.wait({first}, timeout=KEEPALIVE_S)
            if not first.done():
                parts.append(writer.keepalive())
        reply = first.result()
        while True:
            if isinstance(reply, m.ErrorReply):  # the server failed mid-stream
                parts += writer.failed(reply.code, reply.message)
                finished = True
                break
            if isinstance(reply, m.Delta) and reply.text:
                parts += writer.text(reply.text)
            if isinstance(reply, m.Finished):
                finished = True
                parts += writer.end(reply)
                if done is not None:
                    done(reply)
                break
            # Events already here go out as one write (see http._stream).
            if parts and queue.empty():
                yield b"".join(parts)
                parts = []
            reply = await queue.get()
        yield b"".join(parts)
    except Exception as e:  # a bug of ours: the stream ends with the API's error event
        bridge.internal_error()
        structlog.get_logger().warning("http.stream_failed", error=repr(e)[:300], exc_info=True)
        yield b"".join(writer.failed(500, f"internal error: {type(e).__name__}"))
    finally:
        first.cancel()  # the client went before the first reply: no one waits for it
        if not finished:
            bridge.abort(req_id)  # the client went away mid-stream


def sse(event: str, data: bytes) -> bytes:
    """One server-sent event with its name (both APIs name every event)."""
    return b"event: " + event.encode() + b"\ndata: " + data + b"\n\n"
