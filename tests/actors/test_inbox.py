"""actors.shell.Inbox on real ZeroMQ sockets: it waits on the socket's descriptor itself, so
bursts, wake-ups, timeouts and signals that come while nobody waits are its own to get right."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
import zmq
import zmq.asyncio

from actors.shell import Inbox
from protocol.transport import pull_socket, push_socket


class Note(msgspec.Struct, tag=True):
    n: int


def _pair(address: str):
    ctx = zmq.asyncio.Context()
    inbox = Inbox(pull_socket(ctx, address), msgspec.msgpack.Decoder(Note))
    push = push_socket(ctx, address)
    send = lambda n: zmq.Socket.send(push, msgspec.msgpack.encode(Note(n)))  # noqa: E731
    yield inbox, send
    inbox.close()
    ctx.destroy(linger=0)


@pytest.fixture
def pair(tmp_path):
    """The actors' transport: ipc, each message carried by ZMQ's I/O threads."""
    yield from _pair(f"ipc://{tmp_path}/inbox")


@pytest.fixture
def inproc_pair():
    """inproc: send() puts the message in the PULL side's queue before it returns (no I/O
    thread in between), so a test knows what is queued when it starts to wait."""
    yield from _pair("inproc://inbox")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_a_burst_queued_before_the_wait_comes_back_whole_and_in_order(inproc_pair):
    inbox, send = inproc_pair

    async def go():
        for n in range(5):
            send(n)  # inproc: all five are in the PULL side's queue once this returns
        return await inbox.recv_all()

    assert [msg.n for msg in run(go())] == [0, 1, 2, 3, 4]


def test_a_message_sent_during_the_wait_wakes_it(pair):
    inbox, send = pair

    async def go():
        asyncio.get_running_loop().call_later(0.05, send, 7)
        start = time.monotonic()
        got = await inbox.recv_all(timeout=5)
        return got, time.monotonic() - start

    got, waited = run(go())
    assert [msg.n for msg in got] == [7]
    assert waited < 2  # woken by the message, not by the timeout


def test_the_timeout_gives_an_empty_list_and_a_later_message_still_arrives(pair):
    inbox, send = pair

    async def go():
        start = time.monotonic()
        empty = await inbox.recv_all(timeout=0.1)
        waited = time.monotonic() - start
        send(3)
        return empty, waited, await inbox.recv_all(timeout=5)

    empty, waited, later = run(go())
    assert empty == [] and waited >= 0.09
    assert [msg.n for msg in later] == [3]


def test_messages_that_arrive_while_nobody_waits_are_found_by_the_next_wait(pair):
    """The descriptor fires while the actor is busy elsewhere (no waiter): the signal is
    consumed, and the next recv still finds every message."""
    inbox, send = pair
    calls = []
    signal = inbox._signal
    inbox._signal = lambda: (calls.append(inbox._waiter is None), signal())[1]

    async def go():
        send(1)
        first = await inbox.recv_all(timeout=5)
        for n in (2, 3):
            send(n)
        busy_until = time.monotonic() + 0.1
        turns = 0
        while time.monotonic() < busy_until:  # the loop turns, the inbox is not awaited
            await asyncio.sleep(0.01)
            turns += 1
        return first, await inbox.recv_all(timeout=5), turns

    first, then, turns = run(go())
    assert [msg.n for msg in first] == [1]
    assert [msg.n for msg in then] == [2, 3]
    assert turns > 3
    # Consumed once, not called back on every turn of the loop (level-triggered epoll).
    assert sum(calls) <= 3, calls


def test_many_waits_in_a_row_lose_nothing(pair):
    inbox, send = pair

    async def go():
        loop = asyncio.get_running_loop()
        got = []
        for n in range(200):
            loop.call_soon(send, n)
            got += [msg.n for msg in await inbox.recv_all(timeout=5)]
        return got

    assert run(go()) == list(range(200))
