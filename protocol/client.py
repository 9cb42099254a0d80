"""ZMQ client library for mlx-actor-serve, and a command-line client.

    from protocol.client import Client
    with Client("tcp://127.0.0.1:30000") as c:
        r = c.generate("Hello", max_new_tokens=32)         # Result
        for piece in c.generate("Hi", stream=True): ...    # str deltas, then the Result

An error reply (bad request, server shutting down, an actor died) raises ServerError with the
server's message. A lost connection while waiting raises ServerError too, never a hang.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import uuid
from typing import Any, AsyncIterator, Iterator

import msgspec
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol import messages as m

_reply_decoder = msgspec.msgpack.Decoder(m.ClientOutbound)
_encoder = msgspec.msgpack.Encoder()
Result = m.Finished  # .text .token_ids .finish_reason .prompt_tokens .completion_tokens ...


class ServerError(Exception):
    def __init__(self, message: str, code: int = 500, req_id: str = ""):
        super().__init__(message)
        self.message, self.code, self.req_id = message, code, req_id


def _request(prompt: str | list[int] | list[dict] | None, req_id: str | None,
             **kw: Any) -> m.GenerateRequest:
    fields: dict[str, Any] = {}
    if isinstance(prompt, str):
        fields["prompt"] = prompt
    elif prompt and isinstance(prompt[0], dict):
        fields["messages"] = [m.ChatMessage(**msg) for msg in prompt]
    elif prompt:
        fields["input_ids"] = list(prompt)
    return m.GenerateRequest(req_id=req_id or uuid.uuid4().hex, **fields, **kw)


def _piece(reply: Any, req_id: str) -> str | Result:
    """What a caller sees of one reply: a text delta, the result, or a raised error."""
    if isinstance(reply, ServerError):
        raise reply
    if isinstance(reply, m.ErrorReply):
        raise ServerError(reply.message, reply.code, req_id)
    return reply.text if isinstance(reply, m.Delta) else reply


def _dealer(ctx: zmq.Context, address: str) -> tuple[zmq.Socket, zmq.Socket]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    # Watching the connection lets a request fail fast when the server goes away.
    monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
    sock.connect(address)
    return sock, monitor


def _lost(events: list[dict]) -> bool:
    return any(e["event"] == zmq.EVENT_DISCONNECTED for e in events)


class Client:
    """Blocking client: one request at a time per Client (use AsyncClient for concurrency)."""

    def __init__(self, address: str = "tcp://127.0.0.1:30000", timeout: float | None = None):
        self.ctx = zmq.Context()
        self.sock, self.monitor = _dealer(self.ctx, address)
        self.timeout = timeout
        self.open_req: str | None = None
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self.monitor, zmq.POLLIN)

    def generate(self, prompt: str | list[int] | list[dict] | None = None, *,
                 max_new_tokens: int = 128, temperature: float = 0.0, stream: bool = False,
                 stop_token_ids: list[int] = (), ignore_eos: bool = False,
                 req_id: str | None = None, **sampling: Any) -> Result | Iterator[str | Result]:
        """prompt: text, token ids, or chat messages ([{"role": ..., "content": ...}]).
        sampling: any other GenerateRequest field (top_p, top_k, min_p, seed, stop,
        min_new_tokens, logit_bias, repetition/frequency/presence_penalty, logprobs,
        top_logprobs)."""
        req = _request(prompt, req_id, max_new_tokens=max_new_tokens, temperature=temperature,
                       stream=stream, stop_token_ids=list(stop_token_ids),
                       ignore_eos=ignore_eos, **sampling)
        self._forget_old_events()
        self.sock.send(_encoder.encode(req))
        self.open_req = req.req_id
        replies = self._replies(req.req_id)
        if stream:
            return replies
        for reply in replies:
            if isinstance(reply, m.Finished):
                return reply
        raise ServerError("no final reply", req_id=req.req_id)

    def abort(self, req_id: str) -> None:
        self.sock.send(_encoder.encode(m.AbortRequest(req_id=req_id)))

    def _replies(self, req_id: str) -> Iterator[str | Result]:
        timeout_ms = None if self.timeout is None else int(self.timeout * 1000)
        lost = False
        while True:
            # Once the connection dropped, only replies already here can still come.
            ready = dict(self.poller.poll(100 if lost else timeout_ms))
            if not ready:
                if lost:
                    raise ServerError("connection to the server was lost", req_id=req_id)
                raise ServerError(f"no reply within {self.timeout} s", req_id=req_id)
            if self.monitor in ready:
                lost = lost or _lost([parse_monitor_message(self.monitor.recv_multipart())])
            if self.sock in ready:
                reply = _reply_decoder.decode(self.sock.recv())
                if reply.req_id != req_id and reply.req_id:
                    continue  # a late reply to an earlier, abandoned request
                if not isinstance(reply, m.Delta):
                    self.open_req = None
                piece = _piece(reply, req_id)
                yield piece
                if not isinstance(piece, str):
                    return

    def _forget_old_events(self) -> None:
        """Connection events from before this request say nothing about it."""
        while self.monitor.poll(0):
            self.monitor.recv_multipart()

    def close(self) -> None:
        if self.open_req:  # closing mid-request: tell the server, so it frees the row now
            self.abort(self.open_req)
            self.open_req = None
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=500)  # an abort just sent must leave
        self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """asyncio client: many concurrent requests over one connection."""

    def __init__(self, address: str = "tcp://127.0.0.1:30000"):
        self.ctx = zmq.asyncio.Context()
        self.sock, self.monitor = _dealer(self.ctx, address)
        self.waiting: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count()

    async def generate(self, prompt: str | list[int] | list[dict] | None = None, *,
                       stream: bool = False, req_id: str | None = None,
                       **kw: Any) -> Result | AsyncIterator[str | Result]:
        req = _request(prompt, req_id or f"{os.getpid()}-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
                       stream=stream, **kw)
        queue: asyncio.Queue = asyncio.Queue()
        self.waiting[req.req_id] = queue
        self._ensure_reader()
        await self.sock.send(_encoder.encode(req))
        replies = self._replies(req.req_id, queue)
        if stream:
            return replies
        async for reply in replies:
            if isinstance(reply, m.Finished):
                return reply
        raise ServerError("no final reply", req_id=req.req_id)

    async def abort(self, req_id: str) -> None:
        await self.sock.send(_encoder.encode(m.AbortRequest(req_id=req_id)))

    async def _replies(self, req_id: str, queue: asyncio.Queue) -> AsyncIterator[str | Result]:
        try:
            while True:
                piece = _piece(await queue.get(), req_id)
                yield piece
                if not isinstance(piece, str):
                    return
        finally:
            self.waiting.pop(req_id, None)

    def _ensure_reader(self) -> None:
        if self._reader is None or self._reader.done():
            self._reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        poller = zmq.asyncio.Poller()
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        lost = False
        while self.waiting:
            # Once the connection dropped, only replies already here can still come.
            ready = dict(await poller.poll(100 if lost else 1000))
            if not ready and lost:
                for q in self.waiting.values():
                    q.put_nowait(ServerError("connection to the server was lost"))
                lost = False
            if self.monitor in ready:
                lost = lost or _lost([parse_monitor_message(await self.monitor.recv_multipart())])
            if self.sock in ready:
                reply = _reply_decoder.decode(await self.sock.recv())
                q = self.waiting.get(reply.req_id)
                if q is not None:
                    q.put_nowait(reply)
                elif not reply.req_id and isinstance(reply, m.ErrorReply):
                    for q in self.waiting.values():  # an error the server could not attribute
                        q.put_nowait(reply)

    async def close(self) -> None:
        for req_id in list(self.waiting):  # closing mid-request: free the server's rows now
            await self.abort(req_id)
        if self._reader is not None:
            self._reader.cancel()
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=500)  # aborts just sent must leave
        self.ctx.term()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="mas-client", description="Send one prompt, stream the reply.")
    p.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    p.add_argument("--address", default="tcp://127.0.0.1:30000")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--chat", action="store_true", help="send as a user message (chat template)")
    p.add_argument("--timeout", type=float, default=None, help="seconds to wait for each reply")
    args = p.parse_args(argv)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    prompt: Any = [{"role": "user", "content": text}] if args.chat else text
    req_id = uuid.uuid4().hex
    with Client(args.address, timeout=args.timeout) as client:
        try:
            for piece in client.generate(prompt, max_new_tokens=args.max_new_tokens,
                                         temperature=args.temperature, stream=True,
                                         req_id=req_id):
                if isinstance(piece, str):
                    sys.stdout.write(piece)
                    sys.stdout.flush()
                else:
                    print(f"\n[{piece.finish_reason}: {piece.prompt_tokens} prompt + "
                          f"{piece.completion_tokens} completion tokens, ttft "
                          f"{piece.ttft_s * 1000:.0f} ms, total {piece.total_s:.2f} s]",
                          file=sys.stderr)
        except ServerError as e:
            print(f"\nerror: {e.message}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            client.abort(req_id)  # free the server's row now rather than at max_new_tokens
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
