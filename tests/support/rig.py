"""One real actor in its own process, over real ZMQ sockets, with its neighbours played by the test.

The actor is spawned the way launch/supervisor.py spawns it (multiprocessing spawn, its
`main(cfg, addrs, model)`), at addresses derived from the config in a short /tmp folder. The test
binds PULL sockets at the neighbours' inboxes (and the launcher's, for Ready / ActorFailed) and
pushes to the actor's inbox. A test may spawn another entry point in its place (`entry`: a
module-level function in tests/support/ that patches the child, then calls the real main).
Every receive has a timeout and fails the test with a message that names what was awaited
and whether the actor is still alive, instead of hanging.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import msgspec
import pytest
import zmq

from models.info import ModelInfo
from protocol import messages as m
from protocol.codec import decoder, encode
from protocol.config import Config, config_from_dict
from protocol.transport import Addresses, derive_addresses, pull_socket, push_socket

# What each actor's entry point is and which union each inbox decodes (protocol/messages.py).
ENTRIES = {
    "tokenizer": "actors.tokenizer.actor:main",
    "scheduler": "actors.scheduler.actor:main",
    "runner": "actors.model_runner.actor:main",
    "detokenizer": "actors.detokenizer.actor:main",
}
INBOXES = {
    "tokenizer": m.TokenizerInbox,
    "scheduler": m.SchedulerInbox,
    "runner": m.RunnerInbox,
    "detokenizer": m.DetokenizerInbox,
    "launcher": m.LauncherInbox,
}
TIMEOUT_S = 5.0  # any one message; a healthy actor answers in milliseconds
READY_TIMEOUT_S = 60.0  # spawn + imports (+ the tokenizer load) on a busy machine


def make_config(overlap: bool = True, **sections: dict[str, Any]) -> Config:
    """A small config for the tiny built-in model; `sections` override whole keys per section."""
    raw: dict[str, dict[str, Any]] = {
        "model": {"builtin": "qwen3-tiny"},
        "scheduler": {"overlap": overlap, "max_running_requests": 4,
                      "chunked_prefill_size": 64, "output_reserve_tokens": 16},
        "memory": {"kv_tokens": 4096},
        "log": {"level": "warning", "format": "json"},
        "launch": {"ready_timeout_s": 30.0, "stop_timeout_s": 5.0},
    }
    for section, keys in sections.items():
        raw.setdefault(section, {}).update(keys)
    return config_from_dict(raw)


def ipc_addresses(cfg: Config) -> Addresses:
    """Fresh inbox addresses in a short folder (ipc:// paths must stay under ~100 bytes)."""
    return derive_addresses(cfg, tempfile.mkdtemp(prefix="mas-t-", dir="/tmp"))


class ActorProcess:
    """The actor under test, spawned as the supervisor spawns it."""

    def __init__(self, name: str, cfg: Config, addrs: Addresses, model: ModelInfo,
                 entry: str | None = None):
        """entry: "module:function" to run instead of the actor's own main (same arguments);
        spawn pickles it by its qualified name, so it must be a module-level function, e.g.
        one in tests/support/ that patches something in the child and calls the real main."""
        module, func = (entry or ENTRIES[name]).split(":")
        entry = getattr(importlib.import_module(module), func)
        self.name = name
        self.proc = mp.get_context("spawn").Process(
            target=entry, args=(cfg, addrs, model), name=f"mas-test-{name}", daemon=False)

    def start(self) -> None:
        self.proc.start()

    @property
    def exitcode(self) -> int | None:
        return self.proc.exitcode

    def join(self, timeout: float) -> int | None:
        self.proc.join(timeout)
        return self.proc.exitcode

    def check_alive(self, waiting_for: str) -> None:
        if not self.proc.is_alive() and self.proc.exitcode is not None:
            pytest.fail(f"the {self.name} actor exited (code {self.proc.exitcode}) while the "
                        f"test waited for {waiting_for}")

    def kill(self) -> None:
        """Terminate, then kill, whatever is still running; always joined."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(2.0)


class FakeInbox:
    """A neighbour's inbox, bound by the test: a PULL socket with that inbox's typed decoder."""

    def __init__(self, ctx: zmq.Context, addrs: Addresses, name: str, actor: ActorProcess):
        self.name, self.actor = name, actor
        self.sock = pull_socket(ctx, addrs.inbox(name))
        self.dec = decoder(INBOXES[name])

    def recv(self, timeout: float = TIMEOUT_S, what: str = "a message") -> Any:
        """The next message, or a test failure naming what did not come (polls in slices so a
        dead actor fails the test at once, with its exit code)."""
        deadline = time.monotonic() + timeout
        while not self.sock.poll(50):
            self.actor.check_alive(f"{what} at the fake {self.name}")
            if time.monotonic() > deadline:
                pytest.fail(f"no {what} reached the fake {self.name} within {timeout:g} s "
                            f"(the {self.actor.name} actor is "
                            f"{'alive' if self.actor.proc.is_alive() else 'gone'})")
        return self.dec.decode(self.sock.recv())

    def expect(self, cls: type, timeout: float = TIMEOUT_S) -> Any:
        msg = self.recv(timeout, what=cls.__name__)
        if not isinstance(msg, cls):
            pytest.fail(f"the fake {self.name} expected {cls.__name__}, got {msg!r}")
        return msg

    def poll(self, timeout: float) -> Any | None:
        """The next message if one comes within `timeout`, else None (for "nothing comes")."""
        if self.sock.poll(timeout * 1000):
            return self.dec.decode(self.sock.recv())
        return None

    def drain(self) -> list[Any]:
        """Every message already queued (left over from an earlier case)."""
        got = []
        while (msg := self.poll(0)) is not None:
            got.append(msg)
        return got

    def close(self) -> None:
        self.sock.close(linger=0)


class Rig:
    """One actor process, the fake inboxes of the neighbours it pushes to, the launcher's inbox
    and a PUSH socket into the actor's own inbox. `close` always leaves nothing behind: the
    process joined (Shutdown, then terminate, then kill), sockets closed, ipc folder removed."""

    def __init__(self, name: str, cfg: Config, model: ModelInfo, neighbours: tuple[str, ...],
                 entry: str | None = None):
        self.name, self.cfg, self.model = name, cfg, model
        self.addrs = ipc_addresses(cfg)
        self.ctx = zmq.Context()
        self.actor = ActorProcess(name, cfg, self.addrs, model, entry)
        self.launcher = FakeInbox(self.ctx, self.addrs, "launcher", self.actor)
        self.fakes = {n: FakeInbox(self.ctx, self.addrs, n, self.actor) for n in neighbours}
        self.inbox = push_socket(self.ctx, self.addrs.inbox(name))
        self._pushers: list[zmq.Socket] = []
        self.dirty = False  # a test left it in a state the next one must not inherit

    def start(self) -> "Rig":
        self.actor.start()
        return self

    def send(self, *msgs: msgspec.Struct) -> None:
        """Push into the actor's inbox. One socket plays every sender, so what one test sends
        arrives in the order it was sent."""
        for msg in msgs:
            self.inbox.send(encode(msg))

    def pusher(self) -> zmq.Socket:
        """Another PUSH socket into the actor's inbox, for a thread of the test to send on
        (ZMQ sockets are not shared between threads); closed with the rig."""
        sock = push_socket(self.ctx, self.addrs.inbox(self.name))
        self._pushers.append(sock)
        return sock

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> m.Ready:
        msg = self.launcher.recv(timeout, what="Ready")
        if isinstance(msg, m.ActorFailed):
            pytest.fail(f"the {self.name} actor failed at startup: {msg.message}")
        assert msg == m.Ready(actor=self.name, pid=self.actor.proc.pid, info=msg.info)
        return msg

    def shutdown(self, timeout: float = 10.0) -> int | None:
        """Send Shutdown and wait for the exit code (None: still running after `timeout`)."""
        self.send(m.Shutdown(reason="test"))
        return self.actor.join(timeout)

    def inbox_file(self) -> Path:
        return Path(self.addrs.inbox(self.name)[len("ipc://"):])

    def close(self) -> None:
        try:
            if self.actor.proc.is_alive():
                self.shutdown(timeout=5.0)
            self.actor.kill()
        finally:
            for fake in (self.launcher, *self.fakes.values()):
                fake.close()
            for sock in (self.inbox, *self._pushers):
                sock.close(linger=0)
            self.ctx.term()
            shutil.rmtree(self.addrs.ipc_dir, ignore_errors=True)

    def __enter__(self) -> "Rig":
        return self if self.actor.proc.pid is not None else self.start()

    def __exit__(self, *exc) -> None:
        self.close()


class Kept:
    """One actor process kept for a test module's cases: started on first use, started again
    when a case stopped it or left it `dirty`, closed with the module. `start()` returns the
    started rig, Ready awaited; what else it learnt at startup it leaves on the rig."""

    def __init__(self, start: Callable[[], Rig]):
        self.start = start
        self.rig: Rig | None = None

    def get(self) -> Rig:
        rig = self.rig
        if rig is None or rig.dirty or not rig.actor.proc.is_alive():
            if rig is not None:
                rig.close()
            rig = self.rig = self.start()
        return rig

    def close(self) -> None:
        if self.rig is not None:
            self.rig.close()
