"""A recording reverse proxy: put it between a client (an agent CLI) and the server, and it passes
every request through, streaming each response back as it arrives, while keeping a copy of both
bodies. A test then reads what the server sent (the reply text, usage) and compares it with what
the client printed. Plus the readers for the two streamed formats the agents speak."""

from __future__ import annotations

import http.client
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# Headers about one hop, never forwarded (RFC 9110 7.6.1); the proxy frames each hop itself. And
# accept-encoding, so what the server sends (and the proxy keeps) is never compressed.
_HOP = {"connection", "keep-alive", "proxy-connection", "te", "trailer", "transfer-encoding",
        "upgrade", "content-length", "host", "accept-encoding"}


@dataclass
class Exchange:
    """One request through the proxy, its response as the server sent it, and when."""
    method: str
    path: str
    request: bytes = field(repr=False)
    status: int = 0
    response: bytes = field(default=b"", repr=False)
    started: float = 0.0  # time.monotonic() when the request arrived
    ended: float = 0.0
    # (when, body bytes so far) per piece of the response
    arrivals: list[tuple[float, int]] = field(default_factory=list, repr=False)

    def request_json(self) -> dict:
        return json.loads(self.request) if self.request else {}

    def seconds_to(self, marker: bytes) -> float | None:
        """From the request's arrival to that of the response piece where marker first shows
        (b'"content_block_delta"': the first token of a /v1/messages stream)."""
        at = self.response.find(marker)
        if at < 0:
            return None
        return next(t for t, size in self.arrivals if size > at) - self.started


class RecordingProxy:
    """Listens on 127.0.0.1 (a free port), forwards to upstream (http://host:port), records an
    Exchange per request in `exchanges`, in the order they came (each complete once its client
    has read the whole reply). A context manager."""

    def __init__(self, upstream: str):
        target = urlsplit(upstream)
        self.exchanges: list[Exchange] = []
        self._lock = threading.Lock()
        proxy = self

        class Handler(_Forward):
            host, port = target.hostname, target.port or 80

            def record(self, exchange: Exchange) -> None:
                with proxy._lock:
                    proxy.exchanges.append(exchange)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, args=(0.05,),
                                        daemon=True)
        self._thread.start()

    def since(self, start: int, path: str | None = None) -> list[Exchange]:
        """The exchanges recorded after the first `start` ones (to a path starting with path)."""
        with self._lock:
            found = self.exchanges[start:]
        return [e for e in found if path is None or e.path.startswith(path)]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RecordingProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Forward(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    host: str
    port: int

    def record(self, exchange: Exchange) -> None:
        raise NotImplementedError

    def log_message(self, *args) -> None:  # quiet: the exchanges are the record
        pass

    def do_GET(self) -> None:
        self._forward()

    do_POST = do_PUT = do_DELETE = do_GET

    def _forward(self) -> None:
        ex = Exchange(self.command, self.path, self._body(), started=time.monotonic())
        self.record(ex)  # at once: the exchanges stay in the order the requests came
        headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
        upstream = http.client.HTTPConnection(self.host, self.port, timeout=600)
        copy = bytearray()
        try:
            upstream.request(self.command, self.path, body=ex.request, headers=headers)
            reply = upstream.getresponse()
            ex.status = reply.status
            self.send_response(reply.status, reply.reason)
            for k, v in reply.getheaders():
                if k.lower() not in _HOP:
                    self.send_header(k, v)
            bodiless = reply.status in (204, 304)
            self.send_header("Content-Length" if bodiless else "Transfer-Encoding",
                             "0" if bodiless else "chunked")
            self.end_headers()
            while not bodiless and (piece := reply.read1(65536)):  # what has come, no waiting
                copy += piece
                ex.arrivals.append((time.monotonic(), len(copy)))
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
            # Complete before the client can be: one that has read the reply finds it here.
            ex.response, ex.ended = bytes(copy), time.monotonic()
            if not bodiless:
                self.wfile.write(b"0\r\n\r\n")
        finally:  # a client gone mid-reply still leaves the record of what came
            if not ex.ended:
                ex.response, ex.ended = bytes(copy), time.monotonic()
            upstream.close()

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            body = bytearray()
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):  # trailers
                pass
            return bytes(body)
        return self.rfile.read(int(self.headers.get("Content-Length") or 0))


def sse_events(body: bytes) -> list[dict]:
    """The JSON objects of a server-sent event stream's data lines ([DONE] left out)."""
    events = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("data:") and (data := line[5:].strip()) and data != "[DONE]":
            events.append(json.loads(data))
    return events


def anthropic_text(body: bytes) -> str:
    """The text a /v1/messages reply carries: its text_delta pieces when streamed, else its
    text content blocks."""
    if body.lstrip().startswith(b"{"):
        return "".join(b.get("text", "") for b in json.loads(body).get("content", [])
                       if b.get("type") == "text")
    return "".join(e["delta"]["text"] for e in sse_events(body)
                   if e.get("type") == "content_block_delta"
                   and e["delta"].get("type") == "text_delta")


def anthropic_usage(body: bytes) -> dict:
    """A /v1/messages reply's usage: message_start's, updated by message_delta's when streamed."""
    if body.lstrip().startswith(b"{"):
        return json.loads(body).get("usage", {})
    usage: dict = {}
    for e in sse_events(body):
        if e.get("type") == "message_start":
            usage.update(e["message"].get("usage", {}))
        elif e.get("type") == "message_delta":
            usage.update(e.get("usage", {}))
    return usage


def responses_text(body: bytes) -> str:
    """The text a /v1/responses reply carries: its output_text deltas when streamed, else its
    output_text content parts."""
    if body.lstrip().startswith(b"{"):
        return "".join(c.get("text", "") for item in json.loads(body).get("output", [])
                       for c in item.get("content", []) if c.get("type") == "output_text")
    return "".join(e["delta"] for e in sse_events(body)
                   if e.get("type") == "response.output_text.delta")


def responses_usage(body: bytes) -> dict:
    """A /v1/responses reply's usage (the final response object's, when streamed)."""
    if body.lstrip().startswith(b"{"):
        return json.loads(body).get("usage") or {}
    for e in reversed(sse_events(body)):
        if e.get("type") in ("response.completed", "response.incomplete", "response.failed"):
            return e["response"].get("usage") or {}
    return {}


def first_difference(a, b, path: str = "$") -> str | None:
    """Where two JSON values (two recorded request bodies) first differ, walking dicts in a's key
    order and lists by index: the path and both values, shortened; None when equal."""
    if type(a) is not type(b) or not isinstance(a, (dict, list)):
        if a == b:
            return None
        return f"{path}: {json.dumps(a)[:300]} -> {json.dumps(b)[:300]}"
    if isinstance(a, dict):
        for k in [*a, *(k for k in b if k not in a)]:
            if k not in a or k not in b:
                return f"{path}.{k}: only in the {'second' if k in b else 'first'}"
            if found := first_difference(a[k], b[k], f"{path}.{k}"):
                return found
        return None
    for i, (x, y) in enumerate(zip(a, b)):
        if found := first_difference(x, y, f"{path}[{i}]"):
            return found
    return None if len(a) == len(b) else f"{path}: {len(a)} items -> {len(b)}"
