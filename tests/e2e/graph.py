"""Start the real graph (`launch` in a subprocess: real processes, real sockets) for e2e tests."""

from __future__ import annotations

import atexit
import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from launch.benchgraph import alive, stop_graph

ROOT = Path(__file__).resolve().parents[2]
_LAUNCHED: list[subprocess.Popen] = []


@atexit.register
def _kill_leftovers() -> None:
    """A test that failed half way leaves its graph running: end it with the test session
    (SIGINT first, so the launcher takes its actors down, then SIGKILL)."""
    for proc in _LAUNCHED:
        stop_graph(proc, timeout=30)


class Graph:
    def __init__(self, *overrides: str, ready_timeout: float = 240.0):
        args = [sys.executable, "-m", "launch", "--config", str(ROOT / "configs" / "qwen.toml"),
                "--set", "server.port=0", "--set", "server.http_port=0",
                "--set", "log.format=json",
                *[a for o in overrides for a in ("--set", o)]]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, cwd=ROOT)
        _LAUNCHED.append(self.proc)
        self.records: list[dict] = []
        self.http: str | None = None
        self._stderr = threading.Thread(target=self._read_stderr, daemon=True)
        self._stderr.start()
        self.address = self._wait_ready(ready_timeout)

    def _read_stderr(self) -> None:
        for line in self.proc.stderr:
            try:
                self.records.append(json.loads(line))
            except ValueError:
                self.records.append({"event": "raw", "line": line.rstrip()})

    def _wait_ready(self, timeout: float) -> str:
        result: list[str] = []

        def read() -> None:
            for line in self.proc.stdout:
                found = re.search(r"ready: .* client (tcp://\S+)(?: http (http://\S+))?", line)
                if found:
                    result.append(found.group(1))
                    self.http = found.group(2)
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        deadline = time.monotonic() + timeout
        while reader.is_alive() and self.proc.poll() is None and time.monotonic() < deadline:
            reader.join(0.2)  # a launcher that died never prints ready: stop waiting then
        if not result:
            self.proc.kill()
            raise RuntimeError(f"graph not ready in {timeout} s: {self.records[-20:]}")
        return result[0]

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
        self._stderr.join(5)
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
