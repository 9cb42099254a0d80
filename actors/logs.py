"""structlog for every process: JSON lines (file and/or stderr), console in a terminal.

Every record carries actor and pid; per-request work passes rid as a field (contextvars do not
cross processes). Event names are dotted, numbers are fields.

The launcher and the four actors append to one file (`log.file`, which the launcher resolves
before it spawns anyone). What makes that safe:
- each record is one `os.write` of one whole line on an O_APPEND descriptor: the kernel moves
  to the end and writes under the inode's lock, so lines from several processes never
  interleave or overwrite each other (on a local file system; not over NFS);
- only the launcher rotates (launch/logs/files.py: a rename, never a copy), so no two processes
  race to rename the same file (what breaks RotatingFileHandler across processes);
- a writer notices a rotation (the path names another inode) within CHECK_S and reopens; until
  then its lines land in FILE.1, which is kept, and the launcher rotates at most once a second,
  so a line never goes to a file that is being dropped.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from typing import Any, TextIO

import structlog

from protocol.config import LogConfig

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class AppendFile:
    """A JSON-lines file several processes append to, reopened when the launcher rotates it."""

    CHECK_S = 0.5  # how often a writer looks whether the path still names its file

    def __init__(self, path: str):
        self.path = os.path.abspath(path)
        self.lock = threading.Lock()  # the MLX thread logs beside the event loop
        self.fd = self._open()
        self.inode = os.fstat(self.fd).st_ino
        self.checked = time.monotonic()

    def _open(self) -> int:
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        return os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def _reopen(self) -> None:
        try:
            fd = self._open()
        except OSError:
            return  # the folder went away: keep the old file rather than fail the actor
        os.close(self.fd)
        self.fd, self.inode = fd, os.fstat(fd).st_ino

    def _rotated(self) -> bool:
        try:
            return os.stat(self.path).st_ino != self.inode
        except FileNotFoundError:
            return True

    def write(self, line: str) -> None:
        data = (line + "\n").encode("utf-8", "replace")
        with self.lock:
            now = time.monotonic()
            if now - self.checked >= self.CHECK_S:
                self.checked = now
                if self._rotated():
                    self._reopen()
            os.write(self.fd, data)  # one write per line: never interleaved with others

    def close(self) -> None:
        with self.lock:
            os.close(self.fd)


class _Sinks:
    """The last processor: renders one event once per sink format and writes it."""

    def __init__(self, cfg: LogConfig):
        self.json_streams: list[TextIO] = []
        self.file = AppendFile(cfg.file) if cfg.file else None
        self.console: structlog.dev.ConsoleRenderer | None = None
        if cfg.stderr:
            tty = sys.stderr.isatty()
            if cfg.format == "console" or (cfg.format == "auto" and tty):
                self.console = structlog.dev.ConsoleRenderer(colors=tty)
            else:
                self.json_streams.append(sys.stderr)

    def __call__(self, logger: Any, name: str, event: dict[str, Any]) -> str:
        if self.json_streams or self.file is not None:
            line = json.dumps(event, default=str, ensure_ascii=False)
            if self.file is not None:
                self.file.write(line)
            for stream in self.json_streams:
                stream.write(line + "\n")
                stream.flush()
        if self.console is not None:
            sys.stderr.write(self.console(logger, name, dict(event)) + "\n")
        raise structlog.DropEvent


def configure_logging(cfg: LogConfig, actor: str, **fixed: Any) -> None:
    """`fixed`: fields every record of this process carries besides actor and pid."""
    structlog.reset_defaults()
    pid = os.getpid()

    def identity(logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
        # Not contextvars: threads (the runner's MLX thread) do not inherit them.
        event.setdefault("actor", actor)
        event.setdefault("pid", pid)
        for key, value in fixed.items():
            event.setdefault(key, value)
        return event

    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            identity,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # Tracebacks as data, never with locals: locals hold prompts.
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)),
            _Sinks(cfg),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[cfg.level]),
        cache_logger_on_first_use=True,
    )


def get_logger(**fields: Any) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger().bind(**fields)
