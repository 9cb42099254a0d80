"""ZMQ client library for mlx-actor-serve, and a command-line client.

    from protocol.client import Client
    with Client("tcp://127.0.0.1:30000") as c:
        r = c.generate("Hello", max_new_tokens=32)         # Result
        for piece in c.generate("Hi", stream=True): ...    # str deltas, then the Result

The Result of a streamed request is the one a plain call returns: its text is the whole text.
A server with a CURVE keypair (server.curve_*) needs its public key: Client(address,
server_key=...); one with server.api_key needs Client(address, api_key=...).

An error reply (bad request, wrong api_key, server shutting down, an actor died) raises
ServerError with the server's message. A lost connection while waiting, or a server that
refuses the connection's security handshake, raises ServerError too, never a hang.
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
from protocol.transport import curve_client

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


class _Pieces:
    """What a caller sees of one request's replies: text deltas, then the Result (with the
    whole text, also when streamed: the wire's streamed Finished carries none of the deltas'
    text), or a raised error."""

    def __init__(self, req_id: str):
        self.req_id, self.texts = req_id, []

    def __call__(self, reply: Any) -> str | Result:
        if isinstance(reply, ServerError):
            raise reply
        if isinstance(reply, m.ErrorReply):
            raise ServerError(reply.message, reply.code, self.req_id)
        if isinstance(reply, m.Delta):
            self.texts.append(reply.text)
            return reply.text
        if self.texts:
            return msgspec.structs.replace(reply, text="".join(self.texts) + reply.text)
        return reply


_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
           zmq.EVENT_HANDSHAKE_FAILED_AUTH}
_WATCHED = (zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


class _Link:
    """The connection as the socket monitor tells it: lost, or refused by the server's
    security handshake (CURVE), so that a request fails at once with the reason."""

    def __init__(self, ctx: zmq.Context, address: str, server_key: str | bytes | None):
        self.curve = bool(server_key)
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if server_key:
            try:
                curve_client(self.sock, server_key)
            except ValueError:
                self.sock.close()
                raise
        self.monitor = self.sock.get_monitor_socket(_WATCHED)
        self.sock.connect(address)
        self.lost = False
        self.refused: str | None = None  # why the last handshake failed, until one succeeds

    def see(self, frames: list[bytes]) -> None:
        event = parse_monitor_message(frames)
        kind = event["event"]
        if kind == zmq.EVENT_DISCONNECTED:
            self.lost = True
        elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            self.refused = None
        elif kind in _FAILED:
            self.refused = self._refusal(kind, event["value"])

    def _refusal(self, kind: int, value: int) -> str:
        mismatch = (kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                    and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH)
        if not self.curve:  # a plain client is refused only by a server that wants more
            why = "the server" if mismatch else "the server refused the handshake: it likely"
            return (f"{why} requires CURVE encryption: pass its public key (server_key=..., "
                    "mas-client --server-key)")
        if mismatch:
            return "the server does not use CURVE: connect without server_key"
        return ("the CURVE handshake with the server failed: is server_key the server's "
                "public key (server.curve_public_key)?")

    def close(self) -> None:
        self.sock.disable_monitor()
        self.monitor.close(linger=0)
        self.sock.close(linger=500)  # aborts just sent must leave


class Client:
    """Blocking client: one request at a time per Client (use AsyncClient for concurrency)."""

    def __init__(self, address: str = "tcp://127.0.0.1:30000", timeout: float | None = None,
                 server_key: str | bytes | None = None, api_key: str = ""):
        """server_key: the server's CURVE public key (Z85), when it has one; api_key: its
        server.api_key, when it has one."""
        self.ctx = zmq.Context()
        self.link = _Link(self.ctx, address, server_key)
        self.sock, self.monitor = self.link.sock, self.link.monitor
        self.timeout, self.api_key = timeout, api_key
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
                       ignore_eos=ignore_eos, api_key=self.api_key, **sampling)
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
        link, piece_of = self.link, _Pieces(req_id)
        while True:
            if link.refused:
                self.open_req = None
                raise ServerError(link.refused, 401, req_id)
            # Once the connection dropped, only replies already here can still come.
            ready = dict(self.poller.poll(100 if link.lost else timeout_ms))
            if not ready:
                if link.lost:
                    raise ServerError("connection to the server was lost", req_id=req_id)
                raise ServerError(f"no reply within {self.timeout} s", req_id=req_id)
            if self.monitor in ready:
                link.see(self.monitor.recv_multipart())
            if self.sock in ready:
                reply = _reply_decoder.decode(self.sock.recv())
                if reply.req_id != req_id and reply.req_id:
                    continue  # a late reply to an earlier, abandoned request
                if not isinstance(reply, m.Delta):
                    self.open_req = None
                piece = piece_of(reply)
                yield piece
                if not isinstance(piece, str):
                    return

    def _forget_old_events(self) -> None:
        """A disconnect from before this request says nothing about it; a refused handshake
        still does (the server refuses every try the same way)."""
        while self.monitor.poll(0):
            self.link.see(self.monitor.recv_multipart())
        self.link.lost = False

    def close(self) -> None:
        if self.open_req:  # closing mid-request: tell the server, so it frees the row now
            self.abort(self.open_req)
            self.open_req = None
        self.link.close()
        self.ctx.term()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class AsyncClient:
    """asyncio client: many concurrent requests over one connection."""

    def __init__(self, address: str = "tcp://127.0.0.1:30000",
                 server_key: str | bytes | None = None, api_key: str = ""):
        self.ctx = zmq.asyncio.Context()
        self.link = _Link(self.ctx, address, server_key)
        self.sock, self.monitor = self.link.sock, self.link.monitor
        self.api_key = api_key
        self.waiting: dict[str, asyncio.Queue] = {}
        self._reader: asyncio.Task | None = None
        self._ids = itertools.count()

    async def generate(self, prompt: str | list[int] | list[dict] | None = None, *,
                       stream: bool = False, req_id: str | None = None,
                       **kw: Any) -> Result | AsyncIterator[str | Result]:
        req = _request(prompt, req_id or f"{os.getpid()}-{next(self._ids)}-{uuid.uuid4().hex[:8]}",
                       stream=stream, api_key=self.api_key, **kw)
        queue: asyncio.Queue = asyncio.Queue()
        self.waiting[req.req_id] = queue
        self._ensure_reader()
        try:
            await self._send(_encoder.encode(req))
        except ServerError:
            self.waiting.pop(req.req_id, None)
            raise
        replies = self._replies(req.req_id, queue)
        if stream:
            return replies
        async for reply in replies:
            if isinstance(reply, m.Finished):
                return reply
        raise ServerError("no final reply", req_id=req.req_id)

    async def abort(self, req_id: str) -> None:
        try:  # with no connection to send it on, there is nothing on the server to abort
            await self.sock.send(_encoder.encode(m.AbortRequest(req_id=req_id)), zmq.NOBLOCK)
        except zmq.Again:
            pass

    async def _send(self, frame: bytes) -> None:
        """Send, or raise ServerError once the server has refused the connection's handshake:
        a DEALER waits to send while it has no connection, and after a refused handshake it
        may have none until its next attempt is refused too (an awaited send hung there)."""
        while True:
            try:
                await self.sock.send(frame, zmq.NOBLOCK)
                return
            except zmq.Again:
                if self.link.refused:
                    raise ServerError(self.link.refused, 401) from None
                self._ensure_reader()  # it reads the monitor's events
                await asyncio.sleep(0.01)

    async def _replies(self, req_id: str, queue: asyncio.Queue) -> AsyncIterator[str | Result]:
        piece_of = _Pieces(req_id)
        try:
            while True:
                piece = piece_of(await queue.get())
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
        link = self.link
        while self.waiting:
            if link.refused:
                for q in self.waiting.values():
                    q.put_nowait(ServerError(link.refused, 401))
                self.waiting.clear()
            # Once the connection dropped, only replies already here can still come.
            ready = dict(await poller.poll(100 if link.lost else 1000))
            if not ready and link.lost:
                for q in self.waiting.values():
                    q.put_nowait(ServerError("connection to the server was lost"))
                link.lost = False
            if self.monitor in ready:
                link.see(await self.monitor.recv_multipart())
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
        self.link.close()
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
    p.add_argument("--server-key", default=os.environ.get("MAS_SERVER_KEY"),
                   help="the server's CURVE public key (Z85 text, or a file from "
                        "zmq.auth.create_certificates); default $MAS_SERVER_KEY")
    p.add_argument("--api-key", default=os.environ.get("MAS_API_KEY", ""),
                   help="the server's server.api_key; default $MAS_API_KEY")
    args = p.parse_args(argv)
    text = sys.stdin.read() if args.prompt == "-" else args.prompt
    prompt: Any = [{"role": "user", "content": text}] if args.chat else text
    req_id = uuid.uuid4().hex
    try:
        client = Client(args.address, timeout=args.timeout,
                        server_key=_server_key(args.server_key), api_key=args.api_key)
    except (OSError, ValueError) as e:
        print(f"error: --server-key: {e}", file=sys.stderr)
        return 2
    with client:
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


def _server_key(given: str | None) -> bytes | None:
    """--server-key: the key itself, or a certificate file holding its public-key."""
    if not given or not os.path.isfile(given):
        return given.encode() if given else None
    import zmq.auth

    public, _ = zmq.auth.load_certificate(given)
    return public


if __name__ == "__main__":
    sys.exit(main())
