"""The HTTP API's listening socket: every connection asyncio accepts on it has Nagle's
algorithm off (TCP_NODELAY), so a streamed response's last bytes go out at once instead of
waiting for the client's delayed ACK on a reused connection."""

from __future__ import annotations

import asyncio
import socket

from actors.tokenizer.http_front import listening_socket


def test_accepted_connections_have_nodelay():
    async def run() -> int:
        sock = listening_socket("127.0.0.1", 0)
        accepted: asyncio.Future = asyncio.get_running_loop().create_future()

        class Protocol(asyncio.Protocol):
            def connection_made(self, transport):
                accepted.set_result(transport.get_extra_info("socket"))

        server = await asyncio.get_running_loop().create_server(Protocol, sock=sock)
        _, writer = await asyncio.open_connection("127.0.0.1", sock.getsockname()[1])
        conn = await accepted
        flag = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
        writer.close()
        server.close()
        await server.wait_closed()
        return flag

    assert asyncio.run(run()) != 0
