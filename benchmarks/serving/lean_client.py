"""A streaming /v1/completions client that costs the machine as little as it can: the
benchmarks' raw HTTP/1.1 client (benchmarks/raw_http.py), each event one `json.loads`. Events
are what our server and mlx_lm.server send: one `data:` line each; a stream that ends before
its `data: [DONE]` is an error, as it is to the openai client.

Why: on the 2-core machine the benchmark's client shares the cores with the server it
measures. The official `openai` client spends 0.63-0.71 ms of CPU per streamed token (httpx,
one pydantic object per event), more than our tokenizer, scheduler or detokenizer each at
c = 1, and the faster a server streams, the more of its cores the client takes. This one
spends 0.18-0.21 ms (qwen3-small-4bit served at c = 1, the event loop and the kernel's socket work
included; docs/performance.md, "Measuring on a shared 2-core machine"). It is a measuring
instrument, not a user's client (the e2e tests keep the official one);
`load.closed_loop(client_kind="lean")` picks it, the same for every server in a run.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable
from urllib.parse import urlsplit

from benchmarks.raw_http import http_open


class HttpError(Exception):
    pass


async def stream_completion(base_url: str, body: dict[str, Any],
                            on_event: Callable[[dict[str, Any], float], None]) -> None:
    """POST body to {base_url}/completions and call on_event(event, arrival time) for each
    `data:` event of the stream, up to [DONE]."""
    url = urlsplit(base_url)
    stream = await http_open(f"{url.scheme}://{url.netloc}",
                             url.path.rstrip("/") + "/completions", json.dumps(body).encode())
    try:
        if stream.status != 200:
            reply = b"".join([p async for p in stream.pieces()])[:2000]
            raise HttpError(f"HTTP {stream.status} {reply.decode(errors='replace')}")
        async for data in stream.events():
            if data == b"[DONE]":
                return
            on_event(json.loads(data), time.perf_counter())
        raise HttpError("the stream ended before its [DONE] event")
    finally:
        stream.close()
