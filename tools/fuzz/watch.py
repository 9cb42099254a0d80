"""The graph under the fuzz + soak job (tools/fuzz/job.py): started with its JSON logs in a
file that is read back as it grows (actor pids, crash records), and watched for a dead launcher
or actor and the runner's RSS."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from harness.graph import Started, alive, start_graph

ACTORS = ("tokenizer", "scheduler", "runner", "detokenizer")
CRASH_EVENTS = ("actor.crashed", "actor.failed", "actor.died", "launch.failed")


class LogTail:
    """The graph's JSON log file, read as it grows."""

    def __init__(self, path: Path):
        self.path, self.pos, self.rest = path, 0, b""
        self.records: list[dict] = []

    def poll(self) -> list[dict]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.pos)
                data = f.read()
        except FileNotFoundError:
            return self.records
        self.pos += len(data)
        *lines, self.rest = (self.rest + data).split(b"\n")
        for line in lines:
            try:
                self.records.append(json.loads(line))
            except ValueError:
                self.records.append({"event": "raw", "line": line[:300].decode("latin-1")})
        return self.records

    def events(self, name: str) -> list[dict]:
        return [r for r in self.poll() if r.get("event") == name]


@dataclass
class Graph:
    started: Started
    log: LogTail

    def pids(self) -> dict[str, int]:
        return {r["actor"]: r["pid"] for r in self.log.events("actor.ready")}

    def problem(self) -> str:
        """Why the graph is down, or "" while the launcher and every actor run."""
        code = self.started.proc.poll()
        if code is not None:
            return f"launcher exited with code {code}"
        for actor, pid in self.pids().items():
            if not alive(pid):
                return f"actor {actor} (pid {pid}) is gone"
        return ""

    def rss_mib(self, actor: str = "runner") -> float | None:
        try:
            status = Path(f"/proc/{self.pids()[actor]}/status").read_text()
        except (KeyError, OSError):
            return None
        kib = next(int(line.split()[1]) for line in status.splitlines()
                   if line.startswith("VmRSS:"))
        return kib / 1024

    def first_failure(self) -> str:
        """The actor whose failure took the graph down, from the log (the launcher then stops
        the others, so the first pid found gone may be a bystander)."""
        for r in self.log.poll():
            if r.get("event") in ("actor.failed", "actor.died"):
                return f"actor {r.get('name')} failed: {r.get('error') or r.get('exit_code')}"
        return ""

    def crash_records(self) -> list[str]:
        return [json.dumps({k: r.get(k) for k in ("event", "actor", "name", "error", "exit_code")
                            if r.get(k) is not None})[:600]
                for r in self.log.poll() if r.get("event") in CRASH_EVENTS]


def start(model: str, log_path: Path, *overrides: str, ready_s: float = 30.0) -> Graph:
    started = start_graph(f"model.builtin={model}", f"log.file={log_path}",
                          # The watcher reads the file by offset: a soak must never rotate it.
                          "log.max_file_mib=1048576", "log.format=json",
                          *overrides)
    graph = Graph(started, LogTail(log_path))
    deadline = time.monotonic() + ready_s
    while len(graph.pids()) < len(ACTORS) and time.monotonic() < deadline:
        time.sleep(0.1)  # the ready line comes before every actor.ready record is written
    return graph
