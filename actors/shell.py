"""What every actor process shares: logging first, signals, the parent watch, its one inbox,
PUSH sockets to its peers, the Ready handshake and a loud death.

Children ignore SIGINT (the launcher owns the terminal); SIGTERM becomes a Shutdown message in
the actor's own inbox, so every stop goes through the same code path. A child whose launcher
died exits on its own.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

import msgspec
import zmq
import zmq.asyncio

from actors.logs import configure_logging, get_logger
from actors.titles import set_title
from protocol import messages as m
from protocol.codec import decoder, encode
from protocol.config import Config
from models.info import ModelInfo
from protocol.transport import Addresses, actor_name, parse_name, pull_socket, push_socket

# The plain socket's calls, past pyzmq's asyncio wrappers (see Inbox).
_SEND, _RECV = zmq.Socket.send, zmq.Socket.recv


class Shell:
    def __init__(self, name: str, cfg: Config, addrs: Addresses, model: ModelInfo):
        self.name, self.cfg, self.addrs, self.model = name, cfg, addrs, model
        # Data-parallel replica and tensor-parallel rank (both 0 unless configured).
        _, self.replica, self.rank = parse_name(name)
        self.log = get_logger()
        self.zctx = zmq.asyncio.Context()
        self._pushes: dict[str, zmq.asyncio.Socket] = {}
        self._inbox: Inbox | None = None
        # A replica's scheduler and runner talk in pairs: "scheduler" and "runner" are its own.
        self._peers = {base: actor_name(base, self.replica) for base in ("scheduler", "runner")}
        self.on_parent_gone: Callable[[], None] = lambda: None

    def bind_inbox(self, union: Any) -> "Inbox":
        self._inbox = Inbox(pull_socket(self.zctx, self.addrs.inbox(self.name)), decoder(union))
        return self._inbox

    def _push(self, peer: str) -> zmq.asyncio.Socket:
        peer = self._peers.get(peer, peer)
        sock = self._pushes.get(peer)
        if sock is None:
            sock = self._pushes[peer] = push_socket(self.zctx, self.addrs.inbox(peer))
        return sock

    async def send(self, peer: str, msg: msgspec.Struct | bytes) -> None:
        """A message, or one encoded already (bytes)."""
        self.send_now(peer, msg)

    def send_now(self, peer: str, msg: msgspec.Struct | bytes) -> None:
        """Send from synchronous code. A PUSH socket with no high-water mark queues whatever
        its peer has not taken, so the plain non-blocking send always succeeds: pyzmq's
        asyncio send would only add a future per message."""
        _SEND(self._push(peer), msg if isinstance(msg, bytes) else encode(msg), zmq.NOBLOCK)

    async def ready(self, **info: str) -> None:
        self.log.info("actor.ready", **info)
        await self.send("launcher", m.Ready(actor=self.name, pid=os.getpid(), info=info))

    def close(self) -> None:
        if self._inbox is not None:
            self._inbox.close()
        for sock in self._pushes.values():
            sock.close(linger=0)
        self.zctx.destroy(linger=0)
        _unlink_inbox(self.addrs, self.name)


class Inbox:
    """The actor's one PULL socket with its typed decoder.

    It waits on the socket's file descriptor in the actor's event loop and reads with plain
    non-blocking calls. pyzmq's asyncio recv made a future, raised zmq.Again and re-armed its
    reader for every wait: 115-135 us of CPU per message and hop against 70-80 here, where
    blocking ZMQ itself takes ~58 (two processes bouncing one message, this VM). At one
    request every token crosses four hops, on two cores the model's kernels also need.

    The descriptor is ZMQ's edge signal, not a level: it turns readable when the socket's
    state may have changed and stays so until ZMQ_EVENTS is read. So every wait reads the
    socket dry first, and a signal that comes while nobody waits is consumed at once (the
    event loop would otherwise call back on every turn until the next read)."""

    def __init__(self, sock: zmq.Socket, dec: msgspec.msgpack.Decoder):
        self.sock, self.dec = sock, dec
        self._waiter: asyncio.Future | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def recv_all(self, timeout: float | None = None) -> list[Any]:
        """Wait for one message, then take everything already queued, so the actor acts once
        per burst. An empty list means the timeout passed."""
        return [self.dec.decode(f) for f in await self.recv_frames(timeout)]

    async def recv_frames(self, timeout: float | None = None) -> list[bytes]:
        """recv_all's frames, not decoded yet (to pass on as they came)."""
        if frames := self._take():
            return frames
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            loop.add_reader(self.sock.getsockopt(zmq.FD), self._signal)
            self._loop = loop
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            self._waiter = loop.create_future()
            timer = None if deadline is None else loop.call_at(deadline, self._signal)
            try:
                await self._waiter
            finally:
                self._waiter = None
                if timer is not None:
                    timer.cancel()
            if (frames := self._take()) or (deadline is not None and loop.time() >= deadline):
                return frames

    def _take(self) -> list[bytes]:
        frames = []
        while self.sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            frames.append(_RECV(self.sock, zmq.NOBLOCK))
        return frames

    def _signal(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)
        else:
            self.sock.getsockopt(zmq.EVENTS)  # consumes the signal; _take finds the messages

    def close(self) -> None:
        if self._loop is not None and not self._loop.is_closed():
            self._loop.remove_reader(self.sock.getsockopt(zmq.FD))
        self._loop = None


def _unlink_inbox(addrs: Addresses, name: str) -> None:
    address = addrs.inbox(name)
    if not address.startswith("ipc://"):
        return
    path = Path(address[len("ipc://"):])
    path.unlink(missing_ok=True)
    try:
        path.parent.rmdir()  # the last actor out removes the folder if the launcher could not
    except OSError:
        pass


def run_actor(name: str, cfg: Config, addrs: Addresses, model: ModelInfo,
              body: Callable[[Shell], Awaitable[None]]) -> None:
    """Entry point of every actor process."""
    set_title(f"mas-{name}")
    base, replica, _ = parse_name(name)
    # With data parallelism every record of a replica's actors says which replica it is.
    fixed = {"replica": replica} if cfg.scheduler.dp > 1 and base in ("scheduler", "runner") \
        else {}
    configure_logging(cfg.log, name, **fixed)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = asyncio.run(_main(name, cfg, addrs, model, body))
    # The shell is closed (sockets, context): end here, logs flushed, without the
    # interpreter's teardown, whose C++ static destructors (MLX's threads) could abort the
    # process (std::terminate, exit code -6) after a clean shutdown.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


async def _main(name: str, cfg: Config, addrs: Addresses, model: ModelInfo,
                body: Callable[[Shell], Awaitable[None]]) -> int:
    shell = Shell(name, cfg, addrs, model)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(
        signal.SIGTERM, lambda: shell.send_now(name, m.Shutdown(reason="sigterm", drain=True)))
    parent = multiprocessing.parent_process()
    if parent is not None:
        loop.add_reader(parent.sentinel, _parent_gone, shell)
    try:
        await body(shell)
        shell.log.info("actor.stopped")
        return 0
    except Exception as e:  # the actor dies loudly, and tells the launcher why
        shell.log.exception("actor.crashed", error=repr(e))
        try:
            await asyncio.wait_for(
                shell.send("launcher", m.ActorFailed(actor=name, message=repr(e))), 1.0)
        except Exception:
            pass
        return 1
    finally:
        shell.close()


def _parent_gone(shell: Shell) -> None:
    shell.log.error("actor.parent_gone")
    try:
        shell.on_parent_gone()
    finally:
        # The dead launcher's inbox too: nobody else is left to remove it, and the last actor
        # out can then remove the folder.
        _unlink_inbox(shell.addrs, "launcher")
        _unlink_inbox(shell.addrs, shell.name)
        os._exit(1)
