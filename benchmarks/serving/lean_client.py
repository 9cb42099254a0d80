"""A streaming /v1/completions client that costs the machine as little as it can: HTTP/1.1 over
an asyncio stream, the server-sent events split by hand, each event one `json.loads`. Events
are what our server and mlx_lm.server send: one `data:` line each, LF or CRLF line ends; a
stream that ends before its `data: [DONE]` is an error, as it is to the openai client.

Why: on the 2-core machine the benchmark's client shares the cores with the server it
measures. The official `openai` client spends 0.65-0.7 ms of CPU per streamed token (httpx,
one pydantic object per event), more than our tokenizer, scheduler or detokenizer each at
c = 1, and the faster a server streams, the more of its cores the client takes. This one
spends 0.21 ms (qwen3-small-4bit served at c = 1, the event loop and the kernel's socket work
included; BENCHMARKS.md, "Served c = 1: the benchmark's client"). It is a measuring
instrument, not a user's client (the e2e tests keep the official one);
`load.closed_loop(client_kind="lean")` picks it, the same for every server in a run.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from typing import Any, Callable
from urllib.parse import urlsplit


class HttpError(Exception):
    pass


async def stream_completion(base_url: str, body: dict[str, Any],
                            on_event: Callable[[dict[str, Any], float], None]) -> None:
    """POST body to {base_url}/completions and call on_event(event, arrival time) for each
    `data:` event of the stream, up to [DONE]."""
    url = urlsplit(base_url)
    reader, writer = await asyncio.open_connection(url.hostname, url.port or 80)
    try:
        payload = json.dumps(body).encode()
        writer.write(b"POST %s/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: "
                     b"application/json\r\nAccept: text/event-stream\r\nContent-Length: %d"
                     b"\r\nConnection: close\r\n\r\n" % (url.path.rstrip("/").encode(),
                                                         url.netloc.encode(), len(payload))
                     + payload)
        await writer.drain()
        status = await reader.readline()
        if status.split()[1:2] != [b"200"]:  # the reason phrase is optional
            raise HttpError(status.decode(errors="replace").strip()
                            + " " + (await reader.read(2000)).decode(errors="replace"))
        chunked = False
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"transfer-encoding" and b"chunked" in value.lower():
                chunked = True
        pending = b""
        async for data in (_chunks(reader) if chunked else _raw(reader)):
            now = time.perf_counter()
            pending += data
            *events, pending = pending.replace(b"\r\n", b"\n").split(b"\n\n")
            for event in events:
                for line in event.split(b"\n"):
                    if not line.startswith(b"data:"):
                        continue
                    text = line[5:].strip()
                    if text == b"[DONE]":
                        return
                    on_event(json.loads(text), now)
        raise HttpError("the stream ended before its [DONE] event")
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def _raw(reader: asyncio.StreamReader):
    while data := await reader.read(65536):
        yield data


async def _chunks(reader: asyncio.StreamReader):
    """The body of a chunked transfer encoding, chunk by chunk."""
    while True:
        line = await reader.readline()
        if not line:
            raise HttpError("the connection closed inside a chunked body")
        size = int(line.split(b";")[0].strip(), 16)
        if size == 0:
            return
        data = await reader.readexactly(size)
        await reader.readexactly(2)  # the CRLF after each chunk
        yield data
