"""structlog for every process: JSON lines (file and/or stderr), console in a terminal.

Every record carries actor and pid; per-request work passes rid as a field (contextvars do not
cross processes). Event names are dotted, numbers are fields.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Any, TextIO

import structlog

from protocol.config import LogConfig

_LEVELS = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
           "error": logging.ERROR}


class _Sinks:
    """The last processor: renders one event once per sink format and writes it."""

    def __init__(self, cfg: LogConfig):
        self.json_streams: list[TextIO] = []
        self.console: structlog.dev.ConsoleRenderer | None = None
        if cfg.file:
            os.makedirs(os.path.dirname(os.path.abspath(cfg.file)), exist_ok=True)
            self.json_streams.append(open(cfg.file, "a", buffering=1, encoding="utf-8"))
        if cfg.stderr:
            tty = sys.stderr.isatty()
            if cfg.format == "console" or (cfg.format == "auto" and tty):
                self.console = structlog.dev.ConsoleRenderer(colors=tty)
            else:
                self.json_streams.append(sys.stderr)

    def __call__(self, logger: Any, name: str, event: dict[str, Any]) -> str:
        if self.json_streams:
            line = json.dumps(event, default=str, ensure_ascii=False)
            for stream in self.json_streams:
                stream.write(line + "\n")
                stream.flush()
        if self.console is not None:
            sys.stderr.write(self.console(logger, name, dict(event)) + "\n")
        raise structlog.DropEvent


def configure_logging(cfg: LogConfig, actor: str) -> None:
    structlog.reset_defaults()
    pid = os.getpid()

    def identity(logger: Any, name: str, event: dict[str, Any]) -> dict[str, Any]:
        # Not contextvars: threads (the runner's MLX thread) do not inherit them.
        event.setdefault("actor", actor)
        event.setdefault("pid", pid)
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
