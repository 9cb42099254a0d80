"""The SSE response written with the server's own send: the events in order and the body's end;
a client that goes away cancels the events (their `finally` runs at once); a failure under the
stream stays there; and the server's send is used, not Starlette's. (A failure of the events'
own, a bug, is an error event: tests/actors/test_http_stream.py.)"""

from __future__ import annotations

import asyncio

from actors.tokenizer.event_stream import RAW_SEND, EventStream, raw_send_app


class Wire:
    """The server's side: what was sent, and a receive that says disconnect when told."""

    def __init__(self):
        self.sent: list[dict] = []
        self.gone = asyncio.Event()

    async def send(self, message: dict) -> None:
        self.sent.append(message)

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


async def _wrapped_send(message: dict) -> None:
    raise AssertionError("the middleware's send was used")


def _respond(events, wire: Wire) -> EventStream:
    stream = EventStream(events)
    scope = {"type": "http", RAW_SEND: wire.send}
    return stream(scope, wire.receive, _wrapped_send)


def test_events_go_out_in_order_then_the_end_of_the_body():
    async def events():
        for k in range(3):
            yield b"e%d" % k

    async def run():
        wire = Wire()
        await _respond(events(), wire)
        return wire

    wire = asyncio.run(run())
    assert wire.sent[0]["type"] == "http.response.start" and wire.sent[0]["status"] == 200
    assert (b"content-type", b"text/event-stream; charset=utf-8") in wire.sent[0]["headers"]
    assert wire.bodies() == [b"e0", b"e1", b"e2", b""]
    assert wire.sent[-1]["more_body"] is False


def test_a_client_that_goes_away_cancels_the_events_and_their_finally_runs():
    freed = []

    async def events(more: asyncio.Event):
        try:
            yield b"first"
            await more.wait()  # a token that never comes
            yield b"never"
        finally:
            freed.append("aborted")

    async def run():
        wire, more = Wire(), asyncio.Event()
        task = asyncio.ensure_future(_respond(events(more), wire))
        for _ in range(20):
            await asyncio.sleep(0)
        assert wire.bodies() == [b"first"] and freed == []
        wire.gone.set()
        await asyncio.wait_for(task, 5)
        return wire

    wire = asyncio.run(run())
    assert freed == ["aborted"]
    assert b"never" not in wire.bodies()


def test_a_failure_under_the_stream_is_contained_and_the_events_closed():
    closed = []

    async def events():
        try:
            yield b"ok"
            raise KeyError("bug")  # http._stream turns its own into an error event
        finally:
            closed.append(1)

    async def run():
        wire = Wire()
        await _respond(events(), wire)  # returns: the failure is logged, not raised
        return wire

    wire = asyncio.run(run())
    assert wire.bodies() == [b"ok"]
    assert closed == [1]


def test_the_app_wrapper_keeps_the_servers_send_in_the_scope():
    seen = {}

    async def app(scope, receive, send):
        seen.update(scope)

    async def send(message):
        pass

    asyncio.run(raw_send_app(app)({"type": "http"}, None, send))
    assert seen[RAW_SEND] is send
