"""Addresses and sockets. Every edge inside the graph is PUSH -> PULL; each actor binds its one
PULL inbox. Clients reach the tokenizer's ROUTER socket over tcp://."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import msgspec
import zmq

from protocol.config import Config

ACTORS = ("tokenizer", "scheduler", "runner", "detokenizer")


class Addresses(msgspec.Struct, frozen=True):
    """Where each inbox lives. Derived once by the launcher, handed to every child."""

    ipc_dir: str
    tokenizer: str
    scheduler: str
    runner: str
    detokenizer: str
    launcher: str
    client: str  # the tokenizer's ROUTER endpoint; port 0 means "any free port"

    def inbox(self, actor: str) -> str:
        return getattr(self, actor)


def derive_addresses(cfg: Config, ipc_dir: str | None = None) -> Addresses:
    # ipc:// paths must stay short (about 100 bytes on Linux and macOS), hence /tmp.
    folder = ipc_dir or cfg.server.ipc_dir or tempfile.mkdtemp(prefix="mas-", dir="/tmp")
    Path(folder).mkdir(parents=True, exist_ok=True)
    ipc = {name: f"ipc://{os.path.join(folder, name)}" for name in (*ACTORS, "launcher")}
    return Addresses(ipc_dir=folder, client=f"tcp://{cfg.server.host}:{cfg.server.port}", **ipc)


def ipc_files(addrs: Addresses) -> list[Path]:
    return [Path(a[len("ipc://"):]) for a in (addrs.tokenizer, addrs.scheduler, addrs.runner,
                                               addrs.detokenizer, addrs.launcher)]


def bind_tcp(sock: zmq.Socket, address: str) -> str:
    """Bind; with port 0 pick a free port. Returns the address actually bound."""
    if address.startswith("tcp://") and address.endswith(":0"):
        host = address[len("tcp://"):].rsplit(":", 1)[0]
        port = sock.bind_to_random_port(f"tcp://{host}")
        return f"tcp://{host}:{port}"
    sock.bind(address)
    return address


def push_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    # Never block shutdown on peers that are gone.
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(address)
    return sock


def pull_socket(ctx: zmq.Context, address: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.bind(address)
    return sock
