"""Addresses and sockets. Every edge inside the graph is PUSH -> PULL; each actor binds its one
PULL inbox. Clients reach the tokenizer's ROUTER socket over tcp://, encrypted with CURVE when
the server has a keypair (server.curve_*)."""

from __future__ import annotations

import os
import socket
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
    # The inboxes of the other actors by name: data-parallel replicas ("scheduler.1",
    # "runner.1") and tensor-parallel ranks ("runner-1", "runner.1-1"); see actor_name().
    extra: dict[str, str] = {}
    # runner.tp > 1: per replica, the ring backend's "ip:port" of every rank, rank 0 first.
    ring: list[list[str]] = []

    def inbox(self, actor: str) -> str:
        return self.extra[actor] if actor in self.extra else getattr(self, actor)


def actor_name(base: str, replica: int = 0, rank: int = 0) -> str:
    """An actor's name: "scheduler" and "runner" for replica 0 and rank 0, "scheduler.2" for
    replica 2 (scheduler.dp), "runner.2-1" for rank 1 of that replica's runner (runner.tp)."""
    name = base if replica == 0 else f"{base}.{replica}"
    return name if rank == 0 else f"{name}-{rank}"


def parse_name(name: str) -> tuple[str, int, int]:
    """actor_name's inverse: (base, replica, rank)."""
    rest, _, rank = name.partition("-")
    base, _, replica = rest.partition(".")
    return base, int(replica or 0), int(rank or 0)


def graph_actors(cfg: Config) -> list[str]:
    """Every actor process of the graph, in stop order: the tokenizer first, then each
    replica's scheduler, each replica's runner ranks, the detokenizer."""
    dp, tp = cfg.scheduler.dp, cfg.runner.tp
    return ["tokenizer", *[actor_name("scheduler", r) for r in range(dp)],
            *[actor_name("runner", r, k) for r in range(dp) for k in range(tp)], "detokenizer"]


def derive_addresses(cfg: Config, ipc_dir: str | None = None) -> Addresses:
    # ipc:// paths must stay short (about 100 bytes on Linux and macOS), hence /tmp.
    folder = ipc_dir or cfg.server.ipc_dir or tempfile.mkdtemp(prefix="mas-", dir="/tmp")
    Path(folder).mkdir(parents=True, exist_ok=True)
    ipc = {name: f"ipc://{os.path.join(folder, name)}" for name in (*ACTORS, "launcher")}
    extra = {name: f"ipc://{os.path.join(folder, name)}" for name in graph_actors(cfg)
             if name not in ACTORS}
    ring = []
    for r in range(cfg.scheduler.dp if cfg.runner.tp > 1 else 0):
        inboxes, endpoints = _tp_addresses(cfg, r)
        extra.update(inboxes)
        ring.append(endpoints)
    for name, address in cfg.server.inboxes.items():  # the config's choice wins
        if name not in ACTORS and name not in extra:
            raise ValueError(f"server.inboxes: no actor {name!r} in this graph")
        (ipc if name in ACTORS else extra)[name] = address
    return Addresses(ipc_dir=folder, client=f"tcp://{cfg.server.host}:{cfg.server.port}",
                     extra=extra, ring=ring, **ipc)


def _tp_addresses(cfg: Config, replica: int) -> tuple[dict[str, str], list[str]]:
    """Replica `replica`'s remote rank inboxes and ring endpoints. On one machine the inboxes
    stay ipc:// and the ring's ports are free ones unless runner.port fixes them; across
    machines rank k of replica r listens on runner.port + 2 tp r + k for the ring and binds
    its inbox on runner.port + 2 tp r + tp + k."""
    run = cfg.runner
    hosts = run.hosts or ["127.0.0.1"] * run.tp
    first = run.port + 2 * run.tp * replica
    inboxes = {} if run.on_one_host() else {
        actor_name("runner", replica, k): f"tcp://{_host(hosts[k])}:{first + run.tp + k}"
        for k in range(1, run.tp)}
    ports = [first + k for k in range(run.tp)] if run.port else free_ports(hosts[0], run.tp)
    return inboxes, [f"{_host(h)}:{p}" for h, p in zip(hosts, ports)]


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip and not ip.startswith("[") else ip


def free_ports(host: str, n: int) -> list[int]:
    """n distinct TCP ports free on host right now (the ring binds them moments later)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            s.bind((host.strip("[]"), 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def ipc_files(addrs: Addresses) -> list[Path]:
    inboxes = (addrs.tokenizer, addrs.scheduler, addrs.runner, addrs.detokenizer, addrs.launcher,
               *addrs.extra.values())
    return [Path(a[len("ipc://"):]) for a in inboxes if a.startswith("ipc://")]


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


def curve_server(sock: zmq.Socket, public: bytes, secret: bytes) -> None:
    """Make sock a CURVE server (before it binds): every connection is encrypted, and only
    clients that know the public key complete the handshake. Any client keypair is accepted."""
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def curve_client(sock: zmq.Socket, server_key: str | bytes) -> None:
    """Make sock a CURVE client of the server with this public key (before it connects), with a
    fresh keypair of its own."""
    key = server_key.encode() if isinstance(server_key, str) else server_key
    if len(key) != 40:
        raise ValueError(f"server_key: a CURVE public key is 40 Z85 characters, got {len(key)}")
    sock.curve_serverkey = key
    sock.curve_publickey, sock.curve_secretkey = zmq.curve_keypair()
