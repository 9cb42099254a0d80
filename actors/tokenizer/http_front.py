"""The HTTP side of the tokenizer actor: uvicorn in the actor's event loop, and the bridge the
ASGI app talks to (submit, abort, health, metrics) on top of the actor's Frontend."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from typing import Any

import uvicorn

from actors.tokenizer.http import build_app
from protocol import messages as m

# Every HTTP request is answered through this one pseudo client identity: its req_ids are
# unique (one per choice), so replies find their queue by req_id.
HTTP_CLIENT = b"\x00http"
# With requests open and no progress for this long, /health says 503.
STALL_S = 30.0


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the actor shell owns the signals
        yield


class HttpFront:
    def __init__(self, actor: Any):
        self.actor, self.front = actor, actor.front
        cfg = actor.shell.cfg.server
        self.model_name = actor.shell.model.name
        self.api_key = cfg.api_key
        self.queues: dict[str, asyncio.Queue] = {}
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind((cfg.host, cfg.http_port))
        self.sock.listen(128)
        self.address = f"http://{cfg.host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(self), log_config=None, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1)
        self.server = _Server(config)

    async def serve(self) -> None:
        await self.server._serve(sockets=[self.sock])

    async def stop(self) -> None:
        self.server.should_exit = True

    # -- the bridge the app calls ------------------------------------------------------------

    def submit(self, req: m.GenerateRequest, replies: asyncio.Queue) -> None:
        self.queues[req.req_id] = replies
        out, forward = self.front.submit(HTTP_CLIENT, req, time.monotonic())
        for msg in forward:
            self.actor.shell.send_now("scheduler", msg)
            self.actor.metrics.received(req.req_id)
        for _, reply in out:
            self.deliver(reply)

    def abort(self, req_id: str) -> None:
        rid = self.front.by_client.get((HTTP_CLIENT, req_id))
        if rid:
            self.actor.log.info("request.client_gone", rid=rid, req_id=req_id)
            self.actor.shell.send_now("scheduler", m.Abort(rid=rid))

    def deliver(self, reply: m.ClientWire) -> None:
        terminal = isinstance(reply, (m.Finished, m.ErrorReply))
        queue = self.queues.pop(reply.req_id, None) if terminal else self.queues.get(reply.req_id)
        if queue is not None:
            queue.put_nowait(reply)

    def healthy(self) -> bool:
        stalled = self.front.open and time.monotonic() - self.front.last_progress > STALL_S
        return self.front.accepting and not stalled

    def metrics(self) -> str:
        return self.actor.metrics.render(self.model_name, len(self.front.open))

    def token_text(self, token_id: int) -> str:
        return self.front.tokenizer.decode([token_id])
