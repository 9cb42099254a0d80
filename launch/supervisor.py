"""The supervisor: spawn the four actors, wait for each one's Ready, watch them, and shut the
graph down in order when asked (SIGINT/SIGTERM) or when any actor dies.

Shutdown order: the tokenizer first (it refuses new requests, drains open ones up to the
deadline, then answers the rest with an error), then scheduler, runner, detokenizer. Each stage:
a Shutdown message, a grace period, SIGTERM, SIGKILL. No orphans, no leftover ipc files.

The supervisor is also the one process that rotates the run's log file (launch/logs/files.py),
once a second, for as long as it runs.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import shutil
import signal
import sys
import time
from typing import Callable

import zmq
import zmq.asyncio

from actors.logs import get_logger
from launch.logs.files import rotate
from models.info import ModelInfo
from protocol import messages as m
from protocol.codec import decoder, encode
from protocol.config import Config
from protocol.transport import Addresses, pull_socket, push_socket, graph_actors, parse_name

def _entries() -> dict[str, Callable]:
    from actors.detokenizer.actor import main as detokenizer
    from actors.model_runner.entry import main as runner
    from actors.scheduler.actor import main as scheduler
    from actors.tokenizer.actor import main as tokenizer

    return {"detokenizer": detokenizer, "runner": runner, "scheduler": scheduler,
            "tokenizer": tokenizer}


ROTATE_EVERY_S = 1.0  # writers look for a rotation twice as often (actors/logs.py CHECK_S)


class StartupError(RuntimeError):
    pass


class Supervisor:
    def __init__(self, cfg: Config, addrs: Addresses, model: ModelInfo,
                 on_ready: Callable[[dict[str, str]], None], actors: list[str] | None = None):
        self.cfg, self.addrs, self.model, self.on_ready = cfg, addrs, model, on_ready
        # The actors this launcher runs: the whole graph, or its part on this host (--only).
        self.actors = actors if actors is not None else graph_actors(cfg)
        self.partial = "tokenizer" not in self.actors
        self.log = get_logger()
        self.procs: dict[str, mp.Process] = {}
        self.zctx = zmq.asyncio.Context()
        self.exit_code = 0
        self.deaths: list[asyncio.Future] = []  # death reports being collected

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        self.stop: asyncio.Future[tuple[str, bool]] = loop.create_future()
        # For the launcher's whole life: a signal during startup or shutdown must not raise
        # KeyboardInterrupt half way (children would be left to be joined forever).
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        inbox = pull_socket(self.zctx, self.addrs.launcher)
        rotation = asyncio.ensure_future(self._rotate_logs())
        try:
            self._spawn()
            info = await self._wait_ready(inbox)
            self.on_ready(info)
            reason, drain = await self._watch(inbox)
            await self._shutdown(reason, drain)
        except StartupError as e:
            self.log.error("launch.failed", error=str(e))
            print(f"launch failed: {e}", file=sys.stderr, flush=True)
            self.exit_code = 1
            await self._shutdown(str(e), drain=False)
        finally:
            rotation.cancel()
            inbox.close(linger=0)
            self.zctx.destroy(linger=0)
            shutil.rmtree(self.addrs.ipc_dir, ignore_errors=True)
        return self.exit_code

    async def _rotate_logs(self) -> None:
        """Keep the run's log file under log.max_file_mib: this process alone renames it; the
        actors reopen it on their own (actors/logs.py). A failure is logged once."""
        cfg = self.cfg.log
        if not cfg.file:
            return
        warned = False
        while True:
            await asyncio.sleep(ROTATE_EVERY_S)
            try:
                if rotate(cfg.file, cfg.max_file_mib << 20, cfg.backups):
                    self.log.info("log.rotated", file=cfg.file, backups=cfg.backups)
            except OSError as e:
                if not warned:
                    self.log.warning("log.rotate_failed", file=cfg.file, error=str(e))
                    warned = True

    def _stop_once(self, reason: str, drain: bool) -> None:
        if not self.stop.done():
            self.stop.set_result((reason, drain))

    def _on_signal(self, sig: int) -> None:
        if not self.stop.done():
            self._stop_once(signal.Signals(sig).name, True)
        else:  # a second signal while shutting down: stop waiting, kill the children
            self.log.warning("launch.hurry", signal=signal.Signals(sig).name)
            for proc in self.procs.values():
                if proc.is_alive():
                    proc.kill()

    def _spawn(self) -> None:
        ctx = mp.get_context("spawn")
        entries = _entries()
        for name in self.actors:
            entry = entries[parse_name(name)[0]]
            extra = () if name in entries else (name,)
            proc = ctx.Process(target=entry, args=(self.cfg, self.addrs, self.model, *extra),
                               name=f"mas-{name}", daemon=False)
            proc.start()
            self.procs[name] = proc
            self.log.info("actor.spawned", name=name, child_pid=proc.pid)

    async def _wait_ready(self, inbox: zmq.asyncio.Socket) -> dict[str, str]:
        dec = decoder(m.LauncherInbox)
        pending, info = set(self.procs), {}
        deadline = time.monotonic() + self.cfg.launch.ready_timeout_s
        while pending:
            for name in pending:
                code = self.procs[name].exitcode
                if code is not None:
                    raise StartupError(f"actor {name} exited ({exit_text(code)}) before ready")
            left = deadline - time.monotonic()
            if self.stop.done():
                raise StartupError(f"interrupted by {self.stop.result()[0]} while starting")
            if left <= 0:
                names = ", ".join(sorted(pending))
                raise StartupError(f"actor {names} not ready after "
                                   f"{self.cfg.launch.ready_timeout_s:g} s")
            if await inbox.poll(min(left, 0.2) * 1000):
                msg = dec.decode(await inbox.recv())
                match msg:
                    case m.Ready():
                        pending.discard(msg.actor)
                        info.update(msg.info)
                    case m.ActorFailed():
                        raise StartupError(f"actor {msg.actor} failed: {msg.message}")
        return info

    async def _watch(self, inbox: zmq.asyncio.Socket) -> tuple[str, bool]:
        """Wait for the first reason to stop: a signal (drain) or a dead actor (no drain)."""
        loop = asyncio.get_running_loop()
        for name, proc in self.procs.items():
            loop.add_reader(proc.sentinel, lambda n=name: self._died(n))
        dec = decoder(m.LauncherInbox)

        async def failures() -> None:
            while True:
                msg = dec.decode(await inbox.recv())
                if isinstance(msg, m.ActorFailed):
                    self.log.error("actor.failed", name=msg.actor, error=msg.message)

        watcher = asyncio.ensure_future(failures())
        try:
            return await self.stop
        finally:
            watcher.cancel()
            for proc in self.procs.values():
                loop.remove_reader(proc.sentinel)

    def _died(self, name: str) -> None:
        proc = self.procs[name]
        asyncio.get_running_loop().remove_reader(proc.sentinel)  # fires while readable
        self.deaths.append(asyncio.ensure_future(self._report_death(name)))

    async def _report_death(self, name: str) -> None:
        """The sentinel closes while the process exits, before it can be reaped: collect its
        exit code or signal first, so the reason names it."""
        proc = self.procs[name]
        await _join(proc, 5.0)
        if self.partial and proc.exitcode == 0:  # the graph's own shutdown reached it there
            self.log.info("actor.stopped", name=name)
            self._stop_once(f"actor {name} stopped", False)
            return
        self.exit_code = 1
        self.log.error("actor.died", name=name, exit_code=proc.exitcode)
        self._stop_once(f"actor {name} died ({exit_text(proc.exitcode)})", False)

    async def _shutdown(self, reason: str, drain: bool) -> None:
        self.log.info("launch.shutdown", reason=reason, drain=drain)
        for name in self.actors:
            proc = self.procs.get(name)
            if proc is None or not proc.is_alive():
                continue
            sock = push_socket(self.zctx, self.addrs.inbox(name))
            sock.send(encode(m.Shutdown(reason=reason, drain=drain)))
            grace = self.cfg.launch.stop_timeout_s
            if name == "tokenizer" and drain:
                grace += self.cfg.launch.drain_timeout_s
            await _join(proc, grace)
            sock.close(linger=0)
            if proc.is_alive():
                self.log.warning("actor.terminate", name=name)
                proc.terminate()
                await _join(proc, 2.0)
            if proc.is_alive():
                self.log.warning("actor.kill", name=name)
                proc.kill()
                await _join(proc, 2.0)
        for name, proc in self.procs.items():
            self.log.info("actor.exited", name=name, exit_code=proc.exitcode)


def exit_text(code: int | None) -> str:
    """How a process ended, as a person reads it."""
    if code is None:
        return "exit status not collected"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


async def _join(proc: mp.Process, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while proc.is_alive() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)
    proc.join(0)
