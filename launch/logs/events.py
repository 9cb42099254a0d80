"""Log records as the pure core reads them: one JSON line -> one dict, the time filters, and
the other filters (`--since/--until/--actor/--level/--event/--rid-prefix`). No files, no
clock: `now` is passed in.

A record keeps every field it was logged with, plus `_t` (seconds since the epoch, from its
`timestamp`) and `_seq` (its place in what was read), which sort records of several processes
into one time order; `fields()` leaves both out.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from datetime import datetime
from fnmatch import fnmatchcase
from typing import Any, Iterable

Record = dict[str, Any]
LEVELS = {"debug": 10, "info": 20, "warning": 30, "error": 40, "critical": 50}
# Shown apart (columns of a listing or a timeline), so left out of a record's fields.
IDENTITY = frozenset({"event", "timestamp", "actor", "pid", "level", "rid", "_t", "_seq"})


def parse_line(line: str, seq: int = 0) -> Record | None:
    """One JSON log line -> a record with `_t` and `_seq`; None for anything else (a
    traceback's text, a half-written last line, a record without a time)."""
    try:
        rec = json.loads(line)
    except ValueError:
        return None
    if not isinstance(rec, dict) or not isinstance(rec.get("event"), str):
        return None
    t = parse_timestamp(rec.get("timestamp"))
    if t is None:
        return None
    rec["_t"], rec["_seq"] = t, seq
    return rec


def parse_timestamp(value: Any) -> float | None:
    """structlog's ISO time (`2025-06-01T12:00:00.123456Z`) -> epoch seconds."""
    if not isinstance(value, str):
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def parse_records(lines: Iterable[str]) -> list[Record]:
    return in_order(r for i, line in enumerate(lines) if (r := parse_line(line, i)))


def in_order(records: Iterable[Record]) -> list[Record]:
    """Time order; records of one time keep the order they were read in."""
    return sorted(records, key=lambda r: (r["_t"], r["_seq"]))


def fields(rec: Record) -> dict[str, Any]:
    """What a record says beyond who, when and which event."""
    return {k: v for k, v in rec.items() if k not in IDENTITY and v is not None}


_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNIT_S = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_CLOCK = re.compile(r"^\d{1,2}:\d{2}(:\d{2}(\.\d+)?)?$")


def parse_duration(text: str) -> float | None:
    match = _DURATION.match(text.strip())
    return float(match.group(1)) * _UNIT_S[match.group(2)] if match else None


def parse_when(text: str, now: float, start: float | None) -> float:
    """A time bound as a user writes it -> epoch seconds:
    `10m`, `90s`, `2h` (that long before now); `+30s` (after the log's first record);
    `14:05`, `14:05:30.5` (local time on the day of the log's first record, else today);
    `2025-06-01T14:05:30`, with or without a zone (none: local time). ValueError otherwise."""
    text = text.strip()
    if text.startswith("+"):
        d = parse_duration(text[1:])
        if d is None:
            raise ValueError(f"{text!r}: expected +DURATION such as +30s or +5m")
        if start is None:
            raise ValueError(f"{text!r}: the log has no records to count from")
        return start + d
    if (d := parse_duration(text)) is not None:
        return now - d
    if _CLOCK.match(text):
        day = datetime.fromtimestamp(start if start is not None else now)
        return datetime.fromisoformat(f"{day:%Y-%m-%d}T{text}").timestamp()
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError:
        raise ValueError(f"{text!r}: expected a duration (10m, 90s), +DURATION from the "
                         "log's start, a clock time (14:05:30) or an ISO date-time") from None


@dataclass(frozen=True)
class Filter:
    """Which records to keep; every condition given must hold."""

    since: float | None = None  # epoch seconds, inclusive
    until: float | None = None  # epoch seconds, inclusive
    actors: tuple[str, ...] = ()  # any of these
    level: str | None = None  # at least this severe
    event: str | None = None  # a glob: `request.*`, `*.failed`
    rid_prefix: str | None = None
    rid: str | None = None  # exactly this request

    def __call__(self, rec: Record) -> bool:
        t = rec["_t"]
        if self.since is not None and t < self.since:
            return False
        if self.until is not None and t > self.until:
            return False
        if self.actors and rec.get("actor") not in self.actors:
            return False
        if self.level is not None and LEVELS.get(rec.get("level", ""), 0) < LEVELS[self.level]:
            return False
        if self.event is not None and not fnmatchcase(rec["event"], self.event):
            return False
        if self.rid_prefix is not None and not str(rec.get("rid") or "").startswith(
                self.rid_prefix):
            return False
        return self.rid is None or rec.get("rid") == self.rid


def select(records: Iterable[Record], keep: Filter) -> list[Record]:
    return [r for r in records if keep(r)]
