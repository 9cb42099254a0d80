"""A raw HTTP/1.1 client on asyncio streams, for the benchmarks: any bytes as the body, a new
connection per request (closed by the server after its reply), the reply read as it arrives,
server-sent events split by hand. The fuzz job sends malformed requests and drops streams
through it; the serving benchmark's lean client (benchmarks/serving/lean_client.py) streams
completions through it at a fraction of the official client's CPU."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import AsyncIterator
from urllib.parse import urlsplit


@dataclass
class HttpStream:
    status: int
    headers: dict[str, str]
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def pieces(self) -> AsyncIterator[bytes]:
        """The body as it arrives: chunked, by Content-Length, or up to EOF. A connection that
        closes inside a chunked body raises asyncio.IncompleteReadError, not a short body."""
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                line = await self.reader.readline()
                if not line:
                    raise asyncio.IncompleteReadError(b"", None)
                size = int(line.split(b";")[0].strip(), 16)
                if size == 0:
                    return
                yield await self.reader.readexactly(size)
                await self.reader.readexactly(2)
        if "content-length" in self.headers:
            yield await self.reader.readexactly(int(self.headers["content-length"]))
            return
        while data := await self.reader.read(65536):
            yield data

    async def events(self) -> AsyncIterator[bytes]:
        """Server-sent events' data lines, one at a time (LF or CRLF line ends, a CRLF may be
        split between two pieces; `data:` with or without its space)."""
        buf = b""
        async for piece in self.pieces():
            buf = (buf + piece).replace(b"\r\n", b"\n")
            *events, buf = buf.split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if line.startswith(b"data:"):
                        yield line[6:] if line[5:6] == b" " else line[5:]

    def close(self) -> None:
        self.writer.close()


async def http_send(base: str, path: str, body: bytes, method: str = "POST"
                    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Send one request on a new connection (closed by the server after its reply)."""
    url = urlsplit(base)
    reader, writer = await asyncio.open_connection(url.hostname, url.port, limit=1 << 24)
    head = (f"{method} {path} HTTP/1.1\r\nHost: {url.netloc}\r\nContent-Type: application/json"
            f"\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    try:
        writer.write(head + body)
        await writer.drain()
    except ConnectionError:
        pass  # a server may answer (413) and close before a huge body is all sent
    return reader, writer


async def http_open(base: str, path: str, body: bytes, method: str = "POST") -> HttpStream:
    """Send one request and read the reply's head."""
    reader, writer = await http_send(base, path, body, method)
    try:
        status_line = await reader.readline()
        if not status_line:
            raise ConnectionError("connection closed before a reply")
        headers = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        return HttpStream(int(status_line.split()[1]), headers, reader, writer)
    except BaseException:
        writer.close()
        raise


async def http_call(base: str, path: str, body: bytes, timeout: float,
                    method: str = "POST") -> tuple[int, bytes]:
    """One whole request: (status, body)."""
    async with asyncio.timeout(timeout):
        stream = await http_open(base, path, body, method)
        try:
            return stream.status, b"".join([p async for p in stream.pieces()])
        finally:
            stream.close()
