"""The Anthropic routes of the HTTP app (actors/tokenizer/http.py over http_relay.py) driven
through ASGI with a fake bridge that answers with scripted replies: the message and its events,
an error before the reply as an HTTP error and after it as an `error` event, the API key from
x-api-key or a bearer token, the session header, count_tokens; every failure in Anthropic's
shape."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from actors.tokenizer.http import build_app
from protocol import messages as m
from protocol.config import LimitsConfig

BODY = {"model": "claude-x", "max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}]}


class Bridge:
    """The actor side of the app: each request submitted gets `script` (its req_id set)."""

    model_name = "qwen3-tiny"
    strict_model_name = False
    context_length = 64
    limits = LimitsConfig()
    store_items, store_bytes = 8, 1 << 20

    def __init__(self, script: list[Any], api_key: str = ""):
        self.script, self.api_key = script, api_key
        self.submitted: list[m.GenerateRequest] = []
        self.aborted: list[str] = []
        self.errors = 0

    def submit(self, req: m.GenerateRequest, replies: asyncio.Queue, peer: str) -> None:
        self.submitted.append(req)
        for r in self.script:
            replies.put_nowait(type(r)(**{**_fields(r), "req_id": req.req_id}))

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)

    def prompt_tokens(self, req_id: str) -> int:
        return 5

    def tokenize(self, req: m.GenerateRequest) -> list[int]:
        return list(range(sum(len(msg.content) for msg in req.messages)))

    def internal_error(self) -> None:
        self.errors += 1


def _fields(struct: Any) -> dict[str, Any]:
    return {f: getattr(struct, f) for f in struct.__struct_fields__}


def finished(text: str = "", **fields: Any) -> m.Finished:
    return m.Finished(**{"req_id": "", "text": text, "token_ids": [1, 2],
                         "finish_reason": "stop", "prompt_tokens": 5, "completion_tokens": 2,
                         **fields})


def call(bridge: Bridge, path: str, body: bytes | dict,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    """One request through the ASGI app, as uvicorn would make it; the status and the body."""
    async def run() -> tuple[int, bytes]:
        app = build_app(bridge)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        sent: list[dict[str, Any]] = []
        done = asyncio.Event()
        requested = False

        async def receive() -> dict[str, Any]:
            nonlocal requested
            if not requested:
                requested = True
                return {"type": "http.request", "body": raw, "more_body": False}
            await done.wait()  # the client stays until the response ends
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
            if message["type"] == "http.response.body" and not message.get("more_body"):
                done.set()

        path_only, _, query = path.partition("?")
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": path_only,
                 "raw_path": path_only.encode(), "query_string": query.encode(),
                 "root_path": "", "client": ("127.0.0.1", 5000), "server": ("test", 80),
                 "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in
                             {"content-type": "application/json",
                              "content-length": str(len(raw)), **(headers or {})}.items()]}
        await asyncio.wait_for(app(scope, receive, send), 10)
        start = next(s for s in sent if s["type"] == "http.response.start")
        return start["status"], b"".join(s.get("body", b"") for s in sent
                                         if s["type"] == "http.response.body")
    return asyncio.run(run())


def events(raw: bytes) -> list[dict[str, Any]]:
    out = []
    for chunk in raw.decode().split("\n\n")[:-1]:
        name, data = chunk.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert event["type"] == name.removeprefix("event: ")
        out.append(event)
    return out


def error_of(status: int, raw: bytes, kind: str = "invalid_request_error") -> str:
    body = json.loads(raw)
    assert body["type"] == "error" and body["error"]["type"] == kind, body
    return body["error"]["message"]


def test_a_whole_message():
    bridge = Bridge([finished("<think>x</think>\n\nHello.", cached_tokens=3)])
    status, raw = call(bridge, "/v1/messages", BODY)
    message = json.loads(raw)
    assert status == 200 and message["model"] == "qwen3-tiny"
    assert [b["type"] for b in message["content"]] == ["thinking", "text"]
    usage = message["usage"]
    assert (usage["input_tokens"], usage["cache_read_input_tokens"]) == (2, 3)
    (req,) = bridge.submitted
    assert not req.stream and req.max_new_tokens == 16 and bridge.aborted == []


def test_a_streamed_message_with_ping_and_an_error_after_it_began():
    bridge = Bridge([m.Delta(req_id="", text="Hel", token_ids=[1]),
                     m.ErrorReply(req_id="", message="the graph is draining", code=503)])
    status, raw = call(bridge, "/v1/messages", {**BODY, "stream": True})
    evs = events(raw)
    assert status == 200
    assert [e["type"] for e in evs] == ["message_start", "ping", "content_block_start",
                                        "content_block_delta", "error"]
    assert evs[-1]["error"] == {"type": "overloaded_error", "message": "the graph is draining"}
    assert evs[0]["message"]["usage"]["input_tokens"] == 5  # the bridge's prompt_tokens


def test_a_streamed_message_ends_with_message_delta_and_stop():
    bridge = Bridge([m.Delta(req_id="", text="Hel", token_ids=[1]),
                     m.Delta(req_id="", text="lo", token_ids=[2]),
                     finished(finish_reason="length")])
    status, raw = call(bridge, "/v1/messages", {**BODY, "stream": True})
    evs = events(raw)
    assert [e["type"] for e in evs][-2:] == ["message_delta", "message_stop"]
    assert "".join(e["delta"].get("text", "") for e in evs
                   if e["type"] == "content_block_delta") == "Hello"
    assert evs[-2]["delta"]["stop_reason"] == "max_tokens" and bridge.aborted == []


@pytest.mark.parametrize("stream", [False, True])
def test_an_error_before_the_reply_is_an_http_error(stream):
    bridge = Bridge([m.ErrorReply(req_id="", message="prompt has 99 tokens", code=400)])
    status, raw = call(bridge, "/v1/messages", {**BODY, "stream": stream})
    assert status == 400 and error_of(status, raw) == "prompt has 99 tokens"


IMAGE = {**BODY, "messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}


@pytest.mark.parametrize("path, body, says", [
    ("/v1/messages", b"{", "malformed request"),
    ("/v1/messages", {"model": "x", "messages": BODY["messages"]}, "max_tokens"),
    ("/v1/messages", IMAGE, "messages[0].content[0]: image"),
    ("/v1/messages/count_tokens", b"{", "malformed request"),
    ("/v1/messages/count_tokens", IMAGE, "messages[0].content[0]: image")])
def test_bad_bodies_are_400s_in_anthropics_shape(path, body, says):
    bridge = Bridge([])
    status, raw = call(bridge, path, body)
    assert status == 400 and says in error_of(status, raw) and bridge.submitted == []


def test_count_tokens_and_the_beta_query():
    status, raw = call(Bridge([]), "/v1/messages/count_tokens?beta=true",
                       {"model": "x", "system": "abc",
                        "messages": [{"role": "user", "content": "hello"}]},
                       {"anthropic-beta": "token-counting-2024-11-01",
                        "anthropic-version": "2023-06-01"})
    assert status == 200 and json.loads(raw) == {"input_tokens": 8}


def test_the_session_header_names_the_requests_session():
    bridge = Bridge([finished("ok")])
    call(bridge, "/v1/messages", BODY, {"x-claude-code-session-id": "3f2a-session"})
    call(bridge, "/v1/messages", BODY)
    assert [r.session for r in bridge.submitted] == ["3f2a-session", ""]


@pytest.mark.parametrize("headers, served", [
    ({"x-api-key": "sekrit"}, True), ({"authorization": "Bearer sekrit"}, True),
    ({"x-api-key": "wrong"}, False), ({"authorization": "sekrit"}, False), ({}, False)])
@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
def test_the_api_key_from_x_api_key_or_a_bearer_token(headers, served, path):
    status, raw = call(Bridge([finished("ok")], api_key="sekrit"), path, BODY, headers)
    if served:
        assert status == 200
    else:
        assert status == 401 and "API key" in error_of(status, raw, "authentication_error")


@pytest.mark.parametrize("headers", [{"x-api-key": "s\xe9krit"},
                                     {"authorization": "Bearer s\xe9krit"}])
def test_a_non_ascii_key_is_a_401(headers):
    """A key header with bytes past ASCII is a wrong key, not a failure of the server."""
    status, raw = call(Bridge([finished("ok")], api_key="sekrit"), "/v1/messages", BODY,
                       headers)
    assert status == 401 and "API key" in error_of(status, raw, "authentication_error")


def test_a_slow_first_token_opens_the_stream_and_keeps_it_alive(monkeypatch):
    """No reply within OPEN_AFTER_S (a long prefill): message_start goes out at once and a
    ping every KEEPALIVE_S until the first token, then the reply as usual."""
    from actors.tokenizer import http_relay
    monkeypatch.setattr(http_relay, "OPEN_AFTER_S", 0.0)
    monkeypatch.setattr(http_relay, "KEEPALIVE_S", 0.01)

    class Slow(Bridge):
        def submit(self, req, replies, peer):
            self.submitted.append(req)

            async def later():  # the first token after several keepalive periods
                await asyncio.sleep(0.2)
                replies.put_nowait(m.Delta(req_id=req.req_id, text="Hello.", token_ids=[1]))
                replies.put_nowait(m.Finished(**{**_fields(finished()), "req_id": req.req_id}))
            asyncio.get_running_loop().create_task(later())

    status, raw = call(Slow([]), "/v1/messages", {**BODY, "stream": True})
    got = [e["type"] for e in events(raw)]
    assert status == 200 and got[0] == "message_start"
    first_block = got.index("content_block_start")
    assert got[1:first_block].count("ping") >= 3  # begin's ping, then the keepalives
    assert got[-2:] == ["message_delta", "message_stop"]


def test_an_error_after_the_stream_opened_is_an_error_event(monkeypatch):
    from actors.tokenizer import http_relay
    monkeypatch.setattr(http_relay, "OPEN_AFTER_S", 0.0)

    class Refusing(Bridge):
        def submit(self, req, replies, peer):
            asyncio.get_running_loop().call_later(0.05, replies.put_nowait, m.ErrorReply(
                req_id=req.req_id, message="queue full", code=503))

    status, raw = call(Refusing([]), "/v1/messages", {**BODY, "stream": True})
    got = events(raw)
    assert status == 200 and got[0]["type"] == "message_start"
    assert got[-1] == {"type": "error", "error": {"type": "overloaded_error",
                                                  "message": "queue full"}}
