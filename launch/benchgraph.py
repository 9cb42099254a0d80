"""Starting the real graph as a subprocess for the benchmarks (`launch` with --set overrides),
reading its ready line, and stopping it (or any launcher-like process) cleanly."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Started:
    proc: subprocess.Popen
    model: str  # the name the server answers to
    client: str  # tcp:// address of the ZMQ client socket
    http: str  # http:// base URL of the OpenAI API


def start_graph(*overrides: str) -> Started:
    """Launch with the shipped config plus overrides (pick the model with model.builtin=... or
    model.path=...); returns once the graph printed its ready line."""
    args = [sys.executable, "-m", "launch", "--config", str(ROOT / "configs" / "qwen.toml"),
            "--set", "server.port=0", "--set", "server.http_port=0",
            "--set", "log.stderr=false", *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stdout:
        found = re.search(r"ready: model (\S+) client (tcp://\S+) http (http://\S+)", line)
        if found:
            return Started(proc, *found.groups())
    raise RuntimeError(f"the graph did not start (exit code {proc.wait()}): {overrides}")


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
