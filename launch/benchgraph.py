"""Starting the real graph as a subprocess for the benchmarks (`launch` with --set overrides),
and reading its ready line."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_graph(model: str, *overrides: str) -> tuple[subprocess.Popen, str]:
    """Returns the launcher process and the client address once the graph is ready."""
    args = [sys.executable, "-m", "launch", "--config", str(ROOT / "configs" / "qwen.toml"),
            "--set", f"model.builtin={model}", "--set", "server.port=0",
            "--set", "server.http_port=0",
            "--set", "log.stderr=false", *[a for o in overrides for a in ("--set", o)]]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    for line in proc.stdout:
        found = re.search(r"client (tcp://\S+)", line)
        if found:
            return proc, found.group(1)
    raise RuntimeError(f"the graph for {model} did not start (exit code {proc.wait()})")


def stop_graph(proc: subprocess.Popen) -> None:
    proc.send_signal(2)
    proc.wait(60)
