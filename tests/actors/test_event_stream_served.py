"""EventStream under uvicorn itself, with both of its HTTP protocols (httptools, the default
where installed, and h11, the fallback): the events reach a real client in order, and a client
that closes its connection mid-stream ends the events at once (their `finally` runs)."""

from __future__ import annotations

import asyncio
import socket

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.routing import Route

from actors.tokenizer.event_stream import EventStream, raw_send_app


def _app(freed: list, more: asyncio.Event, events_before_wait: int):
    async def events():
        try:
            for k in range(events_before_wait):
                yield b"data: %d\n\n" % k
            await more.wait()  # the next token never comes unless told
            yield b"data: last\n\n"
        finally:
            freed.append("done")

    async def route(request):
        return EventStream(events())

    return raw_send_app(Starlette(routes=[Route("/s", route, methods=["POST"])]))


async def _post(url_port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]:
    """A raw HTTP/1.1 client: the request sent, the response's head read."""
    reader, writer = await asyncio.open_connection("127.0.0.1", url_port)
    writer.write(b"POST /s HTTP/1.1\r\nhost: x\r\ncontent-length: 0\r\n\r\n")
    await writer.drain()
    return reader, writer, await reader.readuntil(b"\r\n\r\n")


async def _chunk(reader: asyncio.StreamReader) -> bytes:
    """One chunk of a chunked body (b"" for the last)."""
    size = int((await reader.readuntil(b"\r\n")).strip(), 16)
    data = await reader.readexactly(size + 2)
    return data[:-2]


async def _served(app, impl: str):
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    sock.listen(8)
    server = uvicorn.Server(uvicorn.Config(app, http=impl, log_config=None, lifespan="off",
                                          timeout_graceful_shutdown=1))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    while not server.started:
        await asyncio.sleep(0.01)
    return server, task, sock.getsockname()[1]


@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_events_reach_the_client_in_order(impl):
    async def run():
        freed, more = [], asyncio.Event()
        more.set()
        server, task, port = await _served(_app(freed, more, 3), impl)
        try:
            reader, writer, head = await _post(port)
            chunks = []
            while chunk := await _chunk(reader):
                chunks.append(chunk)
            writer.close()
            return head, chunks, list(freed)
        finally:
            server.should_exit = True
            await task

    head, chunks, freed = asyncio.run(run())
    assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head.lower()
    assert chunks == [b"data: 0\n\n", b"data: 1\n\n", b"data: 2\n\n", b"data: last\n\n"]
    assert freed == ["done"]


@pytest.mark.parametrize("impl", ["httptools", "h11"])
def test_a_client_that_closes_mid_stream_ends_the_events(impl):
    async def run():
        freed, more = [], asyncio.Event()
        server, task, port = await _served(_app(freed, more, 1), impl)
        try:
            reader, writer, _ = await _post(port)
            assert await _chunk(reader) == b"data: 0\n\n"
            writer.close()  # gone with the stream open
            await writer.wait_closed()
            for _ in range(200):
                if freed:
                    break
                await asyncio.sleep(0.01)
            return list(freed)  # before shutdown cancels what is left
        finally:
            server.should_exit = True
            await task

    assert asyncio.run(run()) == ["done"]
