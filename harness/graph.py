"""Starting the real graph (`launch` in a subprocess: real processes, real sockets) with --set
overrides, waiting for its ready line, reading its logs, and stopping it cleanly. The e2e tests
and the benchmarks both start graphs through here."""

from __future__ import annotations

import atexit
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
READY = re.compile(r"ready: model (\S+) client (tcp://\S+)(?: http (http://\S+))?")
_LAUNCHED: list[subprocess.Popen] = []
_LOG_DIR: list[str] = []


@atexit.register  # before _kill_leftovers, so it runs after it (atexit runs in reverse)
def _remove_log_dir() -> None:
    for folder in _LOG_DIR:
        shutil.rmtree(folder, ignore_errors=True)


def _log_dir() -> str:
    """Graphs started here write their run logs (log.dir) to a temporary folder, not to the
    user's ~/.cache; it goes when this Python process ends."""
    if not _LOG_DIR:
        _LOG_DIR.append(tempfile.mkdtemp(prefix="mas-logs-"))
    return _LOG_DIR[0]


@atexit.register
def _kill_leftovers() -> None:
    """A test or benchmark that failed half way leaves its graph running: end it with the
    Python process that started it."""
    for proc in _LAUNCHED:
        stop_graph(proc, timeout=30)


@dataclass
class Started:
    proc: subprocess.Popen
    model: str  # the name the server answers to
    client: str  # tcp:// address of the ZMQ client socket
    http: str | None  # http:// base URL of the OpenAI API (None when it is off)
    log_reader: threading.Thread | None = None  # feeds on_log until the launcher's stderr ends
    line: str = ""  # the ready line itself


def start_graph(*overrides: str, on_log: Callable[[str], None] | None = None,
                ready_timeout: float | None = None,
                env: dict[str, str] | None = None, root: Path = ROOT) -> Started:
    """Launch with the shipped config plus overrides (pick the model with model.builtin=... or
    model.path=...); returns once the graph printed its ready line. With on_log, every line the
    launcher writes to stderr (JSON log records) goes to it from a reader thread; without, the
    launcher logs nothing to stderr. A launcher that exits, or is not ready within
    ready_timeout seconds (None: no limit), raises RuntimeError. env: variables set for the
    launcher (and so its actors) beside this process's. root: the checkout whose launcher runs
    (its working directory, so it imports its own code, and its configs/qwen.toml): another
    checkout of this repository, to compare against this one."""
    logs = ("log.format=json",) if on_log else ("log.stderr=false",)
    if not any(o.startswith(("log.dir=", "log.file=")) for o in overrides):
        logs = (*logs, f"log.dir={_log_dir()}")
    args = [sys.executable, "-m", "launch", "--config", str(root / "configs" / "qwen.toml"),
            "--set", "server.port=0", "--set", "server.http_port=0",
            *[a for o in (*logs, *overrides) for a in ("--set", o)]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE if on_log else None, text=True, cwd=root,
                            env=None if env is None else {**os.environ, **env})
    _LAUNCHED.append(proc)
    log_reader = None
    if on_log:
        log_reader = threading.Thread(target=_feed, args=(proc.stderr, on_log), daemon=True)
        log_reader.start()
    found = _ready_line(proc, ready_timeout)
    if not found:
        proc.kill()
        raise RuntimeError(f"the graph did not start (exit code {proc.wait()}, ready timeout "
                           f"{ready_timeout} s): {overrides}")
    return Started(proc, *found.groups(), log_reader=log_reader, line=found.string.strip())


def _feed(stream, on_line: Callable[[str], None]) -> None:
    for line in stream:
        on_line(line)


def _ready_line(proc: subprocess.Popen, timeout: float | None) -> re.Match | None:
    found: list[re.Match] = []

    def read() -> None:
        for line in proc.stdout:
            if match := READY.search(line):
                found.append(match)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout if timeout is not None else float("inf")
    while reader.is_alive() and proc.poll() is None and time.monotonic() < deadline:
        reader.join(0.2)  # a launcher that died never prints ready: stop waiting then
    return found[0] if found else None


def stop_graph(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGINT first, so a launcher takes its actors down in order; SIGKILL if it hangs."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def alive(pid: int) -> bool:
    """Running, and not a zombie waiting to be reaped."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


class Graph:
    """A started graph whose JSON log records are kept in memory as they arrive (the e2e tests
    look for events in them)."""

    def __init__(self, *overrides: str, ready_timeout: float = 240.0,
                 env: dict[str, str] | None = None):
        self.records: list[dict] = []
        try:
            self.started = start_graph(*overrides, on_log=self._record,
                                       ready_timeout=ready_timeout, env=env)
        except RuntimeError as e:
            raise RuntimeError(f"{e}\nlast log records: {self.records[-20:]}") from None
        self.proc, self.address, self.http = (self.started.proc, self.started.client,
                                              self.started.http)

    def _record(self, line: str) -> None:
        try:
            self.records.append(json.loads(line))
        except ValueError:
            self.records.append({"event": "raw", "line": line.rstrip()})

    def events(self, name: str, **match) -> list[dict]:
        return [r for r in self.records if r.get("event") == name
                and all(r.get(k) == v for k, v in match.items())]

    def wait_for(self, name: str, timeout: float = 10.0, **match) -> list[dict]:
        """Log records arrive through a pipe: wait for the first matching one."""
        deadline = time.monotonic() + timeout
        while not (found := self.events(name, **match)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return found

    def idle_again(self, idle_before: int, timeout: float = 20.0) -> bool:
        """A scheduler.idle record newer than the first `idle_before` ones, and no leak: the
        scheduler came back to idle with every row, slot and state free."""
        deadline = time.monotonic() + timeout
        while len(self.events("scheduler.idle")) <= idle_before and time.monotonic() < deadline:
            time.sleep(0.05)
        return len(self.events("scheduler.idle")) > idle_before and not self.events(
            "scheduler.leak")

    def actor_pids(self) -> dict[str, int]:
        deadline = time.monotonic() + 10
        while len(self.events("actor.ready")) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)  # log lines travel through a pipe, after the ready line
        return {r["actor"]: r["pid"] for r in self.events("actor.ready")}

    @property
    def ipc_dir(self) -> str:
        return self.events("launch.start")[0]["ipc_dir"]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait(timeout)

    def wait(self, timeout: float = 60.0) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self.started.log_reader.join(5)
        return code

    def wait_gone(self, pids, timeout: float = 20.0) -> list[int]:
        """The pids still alive after the timeout."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            left = [p for p in pids if alive(p)]
            if not left:
                return []
            time.sleep(0.1)
        return [p for p in pids if alive(p)]
