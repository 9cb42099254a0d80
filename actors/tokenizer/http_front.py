"""The HTTP side of the tokenizer actor: uvicorn in the actor's event loop, and the bridge the
ASGI app talks to (submit, abort, health, metrics) on top of the actor's Frontend."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
import time
from typing import Any

import uvicorn

from actors.tokenizer.http import build_app
from models.sizing import kv_bytes_per_token
from protocol import messages as m

# Every HTTP request is answered through this one pseudo client identity: its req_ids are
# unique (one per choice), so replies find their queue by req_id.
HTTP_CLIENT = b"\x00http"
# Probe req_ids: HTTP users cannot choose req_ids, so these never meet theirs.
PROBE_PREFIX = "health-probe-"


def listening_socket(host: str, port: int) -> socket.socket:
    """The HTTP API's listening socket. IPPROTO_TCP named: asyncio sets TCP_NODELAY only on
    connections whose socket says TCP. With proto 0 they kept Nagle's algorithm, and on a
    reused connection the end of each streamed response waited ~40 ms for the client's
    delayed ACK (a one-token request: 52 ms instead of 12)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    return sock


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the actor shell owns the signals
        yield


class HttpFront:
    def __init__(self, actor: Any):
        self.actor, self.front = actor, actor.front
        cfg = actor.shell.cfg.server
        self.model_name = actor.shell.model.name
        self.strict_model_name = cfg.strict_model_name
        self.context_length = actor.shell.model.context_length
        # One KV page's bytes on one runner rank, for /metrics' mas:kv_pool_bytes.
        self.page_bytes = m.KV_PAGE * kv_bytes_per_token(actor.shell.cfg, actor.shell.model)
        self.api_key = cfg.api_key
        self.limits = actor.shell.cfg.limits
        self.store_items, self.store_bytes = cfg.response_store_items, cfg.response_store_mib << 20
        self.health_timeout_s = cfg.health_timeout_s
        # A step answered this recently proves every actor alive; older, /health probes.
        self.health_recent_s = cfg.health_recent_s
        self.probe: asyncio.Future | None = None  # shared by /health calls while it runs
        self.probes = 0
        self.queues: dict[str, asyncio.Queue] = {}
        self.sock = listening_socket(cfg.host, cfg.http_port)
        self.address = f"http://{cfg.host}:{self.sock.getsockname()[1]}"
        config = uvicorn.Config(build_app(self), log_config=None, access_log=False,
                                lifespan="off", timeout_graceful_shutdown=1)
        self.server = _Server(config)

    async def serve(self) -> None:
        await self.server._serve(sockets=[self.sock])

    async def stop(self) -> None:
        self.server.should_exit = True

    # -- the bridge the app calls ------------------------------------------------------------

    def submit(self, req: m.GenerateRequest, replies: asyncio.Queue, peer: str = "") -> None:
        self.queues[req.req_id] = replies
        out, forward = self.front.submit(HTTP_CLIENT, req, time.monotonic(), peer=peer)
        self.actor.to_schedulers(forward)
        self.actor._send_now(out)  # a refusal: counted and delivered like any reply

    def abort(self, req_id: str) -> None:
        self.actor.to_schedulers(self.front.abort(HTTP_CLIENT, req_id, "request.client_gone"))

    def deliver(self, reply: m.ClientWire) -> None:
        terminal = isinstance(reply, (m.Finished, m.ErrorReply))
        queue = self.queues.pop(reply.req_id, None) if terminal else self.queues.get(reply.req_id)
        if queue is not None:
            queue.put_nowait(reply)

    async def healthy(self) -> bool:
        """Accepting, and a step went through every actor recently: a recent reply shows it,
        otherwise a one-token request sent through the whole graph now (tokenizer, scheduler,
        runner, detokenizer) must come back within health_timeout_s. A wedged actor fails it
        as surely as a dead one."""
        if not self.front.accepting:
            return False
        if time.monotonic() - self.front.last_progress < self.health_recent_s:
            return True
        if self.probe is None or self.probe.done():
            self.probe = asyncio.ensure_future(self._probe())
        return await asyncio.shield(self.probe)

    async def _probe(self) -> bool:
        self.probes += 1
        req_id = f"{PROBE_PREFIX}{self.probes}"
        replies: asyncio.Queue = asyncio.Queue()
        self.submit(m.GenerateRequest(req_id=req_id, input_ids=[0], max_new_tokens=1,
                                      ignore_eos=True), replies, "health")
        try:
            async with asyncio.timeout(self.health_timeout_s):
                while not isinstance(reply := await replies.get(), (m.Finished, m.ErrorReply)):
                    pass
        except TimeoutError:
            self.actor.log.error("health.probe_timeout", req_id=req_id,
                                 timeout_s=self.health_timeout_s)
            self.abort(req_id)
            self.queues.pop(req_id, None)
            return False
        if isinstance(reply, m.ErrorReply):
            self.actor.log.error("health.probe_failed", req_id=req_id, error=reply.message)
        return isinstance(reply, m.Finished)

    def internal_error(self) -> None:
        self.front.internal_errors += 1

    def server_info(self) -> dict[str, Any]:
        cfg, model = self.actor.shell.cfg, self.actor.shell.model
        return {"served_model_name": self.model_name, "model_path": model.path,
                "context_length": model.context_length, "tp_size": cfg.runner.tp,
                "dp_size": cfg.scheduler.dp,
                "max_running_requests": cfg.scheduler.max_running_requests,
                "max_running_requests_why": model.sizing,
                "engine": "mlx-actor-serve"}

    def tokenize(self, req: m.GenerateRequest) -> list[int]:
        return self.front.tokenize(req)

    def prompt_tokens(self, req_id: str) -> int:
        """An open HTTP request's prompt tokens (0 once it ended or if it was refused)."""
        rid = self.front.by_client.get((HTTP_CLIENT, req_id))
        return self.front.open[rid].prompt_tokens if rid in self.front.open else 0

    def metrics(self) -> str:
        cfg = self.actor.shell.cfg
        return self.actor.metrics.render(self.model_name, len(self.front.open),
                                         self.front.internal_errors, self.front.router.routed,
                                         running_cap=cfg.scheduler.max_running_requests,
                                         sizing=self.actor.shell.model.sizing,
                                         page_bytes=self.page_bytes)

    @functools.lru_cache(maxsize=1 << 16)
    def token_text(self, token_id: int) -> str:
        """One token's text for logprobs (up to 21 per token with top_logprobs=20): cached."""
        return self.front.tokenizer.decode([token_id])
