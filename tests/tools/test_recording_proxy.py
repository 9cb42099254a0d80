"""The agent tests' recording proxy (harness/proxy.py) against a fake upstream: a streamed reply
passes through as it is sent (the client reads the first event before the upstream writes the
second), both bodies are kept, a chunked request body arrives whole; and the readers of the
two streamed formats, and the JSON differ that explains a cache miss."""

from __future__ import annotations

import http.client
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.proxy import (RecordingProxy, anthropic_text, anthropic_usage, first_difference,
                           responses_text, responses_usage)


def sse(*events: dict) -> bytes:
    return b"".join(b"event: %s\ndata: %s\n\n" % (e["type"].encode(), json.dumps(e).encode())
                    for e in events)


FIRST = sse({"type": "message_start", "message": {"usage": {"input_tokens": 9}}},
            {"type": "content_block_delta", "delta": {"type": "text_delta", "text": "Hel"}})
SECOND = sse({"type": "content_block_delta", "delta": {"type": "text_delta", "text": "lo"}},
             {"type": "message_delta", "usage": {"input_tokens": 2,
                                                 "cache_read_input_tokens": 7}})


@pytest.fixture
def upstream():
    """Streams FIRST, waits for `go`, streams SECOND; echoes the request body in a header."""
    go = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args):
            pass

        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("X-Body", body.decode())
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(FIRST)
            self.wfile.flush()
            go.wait(5)
            self.wfile.write(SECOND)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", go
    go.set()
    server.shutdown()
    server.server_close()


def test_streams_through_promptly_and_records_both_bodies(upstream):
    url, go = upstream
    with RecordingProxy(url) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", int(proxy.url.rsplit(":", 1)[1]),
                                          timeout=5)
        conn.putrequest("POST", "/v1/messages?beta=true")
        conn.putheader("Transfer-Encoding", "chunked")
        conn.endheaders()
        conn.send(b"3\r\n{\"a\r\n5\r\n\": 1}\r\n0\r\n\r\n")
        reply = conn.getresponse()
        assert reply.getheader("X-Body") == '{"a": 1}'
        got = b""
        while len(got) < len(FIRST):  # before the upstream has written SECOND
            got += reply.read1(65536)
        assert got == FIRST
        go.set()
        assert got + reply.read() == FIRST + SECOND
        conn.close()
    (ex,) = proxy.exchanges
    assert (ex.method, ex.path, ex.status) == ("POST", "/v1/messages?beta=true", 200)
    assert ex.request_json() == {"a": 1} and ex.response == FIRST + SECOND
    assert 0 <= ex.seconds_to(b"content_block_delta") < ex.ended - ex.started
    assert anthropic_text(ex.response) == "Hello"
    assert anthropic_usage(ex.response) == {"input_tokens": 2, "cache_read_input_tokens": 7}


def test_readers_of_responses_replies():
    done = {"status": "completed", "usage": {"input_tokens": 9,
                                             "input_tokens_details": {"cached_tokens": 8}},
            "output": [{"type": "message", "content": [{"type": "output_text", "text": "Hi"}]}]}
    streamed = sse({"type": "response.output_text.delta", "delta": "H"},
                   {"type": "response.output_text.delta", "delta": "i"},
                   {"type": "response.completed", "response": done}) + b"data: [DONE]\n\n"
    for body in (streamed, json.dumps(done).encode()):
        assert responses_text(body) == "Hi"
        assert responses_usage(body)["input_tokens_details"]["cached_tokens"] == 8


def test_first_difference_names_the_path():
    a = {"system": "s", "messages": [{"role": "user", "content": "hi"}]}
    assert first_difference(a, a) is None
    assert first_difference(a, {**a, "messages": [*a["messages"], {"role": "assistant"}]}) == (
        "$.messages: 1 items -> 2")
    changed = {"system": "t", "messages": a["messages"]}
    assert first_difference(a, changed) == '$.system: "s" -> "t"'
    assert first_difference({"x": [1]}, {"x": "1"}) == '$.x: [1] -> "1"'
