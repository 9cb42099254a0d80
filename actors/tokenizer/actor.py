"""The tokenizer actor: the client ROUTER socket and the graph's front door. Thin shell around
Frontend: client frames in, TokenizedRequests to the scheduler; TextBatches in, replies out."""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message

from actors.shell import Shell, run_actor
from actors.tokenizer.frontend import Frontend, Outbound, Reply
from actors.tokenizer.http_front import HTTP_CLIENT, PROBE_PREFIX, HttpFront
from models.tokenizer import load_tokenizer
from actors.tokenizer.metrics import Metrics
from actors.tokenizer.router import Router
from protocol import messages as m
from protocol.codec import encode
from protocol.config import ServerConfig, is_loopback
from protocol.transport import actor_name, bind_tcp, curve_server


class TokenizerActor:
    def __init__(self, shell: Shell):
        self.shell, self.log = shell, shell.log
        server = shell.cfg.server
        sched = shell.cfg.scheduler
        router = Router(sched.dp, slack=max(1, sched.max_running_requests // 2))
        self.front = Frontend(load_tokenizer(shell.model.path), shell.model, shell.log,
                              shell.cfg.limits, api_key=server.api_key, router=router)
        self.inbox = shell.bind_inbox(m.TokenizerInbox)
        self.router = shell.zctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # A reply to a client that went away is dropped, never an error that stops the actor.
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 0)
        # A peer that vanished without closing its socket (host down, cable out) is found by
        # ZMTP heartbeats; a killed process by the kernel closing its connection.
        self.router.setsockopt(zmq.HEARTBEAT_IVL, 2000)
        self.router.setsockopt(zmq.HEARTBEAT_TIMEOUT, 10000)
        # A frame over limits.max_frame_bytes gets an error reply naming the limit; one over
        # twice that is never buffered whole: ZMQ drops the connection that sends it.
        self.router.setsockopt(zmq.MAXMSGSIZE, 2 * shell.cfg.limits.max_frame_bytes)
        curve = server.curve_keys()
        if curve is not None:
            curve_server(self.router, *curve)
        self.client_address = bind_tcp(self.router, shell.addrs.client)
        # ROUTER_NOTIFY is draft-only in the wheels, so a lost client is found from the
        # monitor's DISCONNECTED event, whose value is the connection's fd, and the fd each
        # message arrived on (SRCFD). fd -> identities seen on it.
        self.peers = Peers(self.router)
        # Drained without awaiting after each poll (a sync view of the same socket).
        self.router_now = zmq.Socket.shadow(self.router.underlying)
        shell.on_parent_gone = self._parent_gone
        self.metrics = Metrics()
        self.http = HttpFront(self) if server.http_port >= 0 else None
        if unguarded := insecure_endpoints(server, curve is not None, self.http is not None):
            self.log.warning("server.insecure_bind", host=server.host, endpoints=unguarded,
                             hint="set server.api_key, and server.curve_* keys for ZMQ")

    async def serve(self) -> None:
        info = {"client": self.client_address}
        if self.http is not None:
            info["http"] = self.http.address
        # Set before any request can come: compiling threads wake the loop through it.
        self._woken = asyncio.Event()
        loop = asyncio.get_running_loop()
        self.front.wake = lambda: loop.call_soon_threadsafe(self._woken.set)
        await self.shell.ready(**info)
        try:
            # A failure in any loop takes the actor down loudly (TaskGroup re-raises).
            async with asyncio.TaskGroup() as tasks:
                side = [tasks.create_task(self._clients()), tasks.create_task(self._compiles())]
                if self.http is not None:
                    side.append(tasks.create_task(self.http.serve()))
                await self._inbox()
                if self.http is not None:
                    await self.http.stop()
                for task in side:
                    task.cancel()
        finally:
            self.peers.close()
            # Linger: the error replies of a shutdown must reach their clients.
            self.router.close(linger=2000)

    async def _clients(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.router, zmq.POLLIN)
        poller.register(self.peers.monitor, zmq.POLLIN)
        while True:
            await poller.poll()
            while True:
                # Disconnects first, before every message: a closed connection's fd can be
                # reused by a new client. libzmq queues the old connection's DISCONNECTED
                # event before it closes the fd, so before the new connection's first message
                # is readable, but maybe after the previous message was read: checking once
                # per poll put the new client on the old fd, and its requests were aborted
                # with the old connection (found by the soak in tools/fuzz/job.py).
                await self._abort_gone()
                if (frames := self._recv_client()) is None:
                    break
                replies, forward = self.front.on_client(frames, time.monotonic())
                self.to_schedulers(forward)
                await self._reply(replies)

    async def _compiles(self) -> None:
        """Requests whose grammars compile on threads (compiles.py): opened or refused when a
        compile ends, times out or its request is aborted. The loop is woken by the
        compiling thread, or sleeps until the next compile's deadline."""
        while True:
            deadline = self.front.next_deadline()
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._woken.wait(), wait)
            self._woken.clear()
            replies, forward = self.front.compiled(time.monotonic())
            self.to_schedulers(forward)
            await self._reply(replies)

    def to_schedulers(self, forward: list[Outbound]) -> None:
        """Each message to its replica's scheduler (PUSH with no high-water mark never
        blocks)."""
        for replica, data in forward:
            self.shell.send_now(actor_name("scheduler", replica), data)

    async def _abort_gone(self) -> None:
        for identity in self.peers.gone():
            self.to_schedulers(self.front.client_gone(identity))

    def _recv_client(self) -> list[bytes] | None:
        try:
            frames = self.router_now.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self.peers.seen(frames[0])
        return [f.bytes for f in frames]

    async def _inbox(self) -> None:
        while True:
            stop = None
            # Every TextBatch of the read is delivered, also those read after a Shutdown:
            # dropping one would lose tokens of a request that the drain then finishes.
            for msg in await self.inbox.recv_all():
                match msg:
                    case m.TextBatch():
                        self.metrics.scheduler_load(msg.running, msg.queued, msg.replica,
                                                    msg.kv_pages)
                        await self._reply(self.front.on_text(msg, time.monotonic()))
                    case m.Shutdown():
                        stop = stop or msg
            if stop is not None:
                await self._shutdown(stop)
                return

    async def _shutdown(self, msg: m.Shutdown) -> None:
        """Drain: refuse new requests, let open ones finish until the deadline; then every
        request still open gets an error reply naming the reason."""
        self.front.accepting = False
        self.front.refusal = f"server is shutting down: {msg.reason}"
        if msg.drain:
            deadline = time.monotonic() + self.shell.cfg.launch.drain_timeout_s
            while self.front.open and time.monotonic() < deadline:
                for inner in await self.inbox.recv_all(timeout=0.05):
                    if isinstance(inner, m.TextBatch):
                        await self._reply(self.front.on_text(inner, time.monotonic()))
        self.log.info("tokenizer.shutdown", reason=msg.reason, open=len(self.front.open))
        await self._reply(self.front.fail_all(f"server is shutting down: {msg.reason}"))

    def _route(self, identity: bytes, reply: m.ClientWire) -> bytes | None:
        """Count the reply; hand HTTP replies to their queue; return the frame for a ZMQ one."""
        if not (identity == HTTP_CLIENT and reply.req_id.startswith(PROBE_PREFIX)):
            self.metrics.reply(reply)  # health probes are not traffic
        if identity == HTTP_CLIENT:
            self.http.deliver(reply)
            return None
        return encode(reply)

    async def _reply(self, replies: list[Reply]) -> None:
        for identity, reply in replies:
            if (data := self._route(identity, reply)) is not None:
                await self.router.send_multipart([identity, data])

    def _parent_gone(self) -> None:
        """The launcher died: every open request gets its error before the process exits
        (os._exit, actors/shell.py), which would drop what the sockets still queue. So the
        router closes with a linger and the context is terminated here: that waits (up to the
        linger) until the replies have left."""
        self._send_now(self.front.fail_all("server launcher died"))
        self.peers.close()
        self.router.close(linger=1000)
        self.shell.zctx.destroy(linger=0)  # every other socket: nothing of theirs matters now

    def _send_now(self, replies: list[Reply]) -> None:
        """From synchronous code (the parent-gone hook): never blocks."""
        for identity, reply in replies:
            if (data := self._route(identity, reply)) is not None:
                self.router.send_multipart([identity, data], zmq.NOBLOCK)


class Peers:
    """Which client identities each connection carried, and which identities lost theirs."""

    def __init__(self, router: zmq.Socket):
        self.router = router
        self.monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self.monitor_now = zmq.Socket.shadow(self.monitor.underlying)
        self.by_fd: dict[int, set[bytes]] = {}

    def seen(self, identity_frame: zmq.Frame) -> None:
        self.by_fd.setdefault(identity_frame.get(zmq.SRCFD), set()).add(identity_frame.bytes)

    def gone(self) -> list[bytes]:
        lost: list[bytes] = []
        while True:
            try:
                event = recv_monitor_message(self.monitor_now, zmq.NOBLOCK)
            except zmq.Again:
                return lost
            if event["event"] == zmq.EVENT_DISCONNECTED:
                lost += self.by_fd.pop(event["value"], ())

    def close(self) -> None:
        self.router.disable_monitor()
        self.monitor.close(linger=0)


def insecure_endpoints(server: ServerConfig, curve: bool, http: bool) -> list[str]:
    """The client endpoints other machines can reach with nothing asking who they are."""
    if is_loopback(server.host) or server.api_key:
        return []
    return [name for name, on in (("zmq", not curve), ("http", http)) if on]


async def serve(shell: Shell) -> None:
    await TokenizerActor(shell).serve()


def main(cfg, addrs, model) -> None:
    run_actor("tokenizer", cfg, addrs, model, serve)
