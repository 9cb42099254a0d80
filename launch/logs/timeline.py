"""The life of one request, across the four actors, in time order: every record that carries
its rid (received and tokenized, queued, admitted with its row and cached tokens, each prefill
chunk, the first token, retractions, abort, the end), with the time since the first step and
since the previous one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable

from launch.logs.events import Record, fields, in_order


@dataclass(frozen=True)
class Step:
    t: float  # epoch seconds
    since_start: float  # seconds since the request's first record
    gap: float  # seconds since the previous step (0 for the first)
    actor: str
    event: str
    level: str
    fields: dict[str, Any]

    def as_dict(self) -> dict[str, Any]:
        return {"t": self.t, "since_start_s": round(self.since_start, 6),
                "gap_s": round(self.gap, 6), "actor": self.actor, "event": self.event,
                "level": self.level, **self.fields}


def find_rids(records: Iterable[Record], key: str) -> list[str]:
    """The rids `key` names: itself when some record carries it as rid, else the rids of the
    requests whose client req_id is `key` (in order of arrival; one client id may be reused)."""
    by_req_id: list[str] = []
    for rec in records:
        rid = rec.get("rid")
        if rid == key:
            return [key]
        if rec.get("req_id") == key and rid and rid not in by_req_id:
            by_req_id.append(rid)
    return by_req_id


def timeline(records: Iterable[Record], rid: str) -> list[Step]:
    mine = in_order(r for r in records if r.get("rid") == rid)
    steps: list[Step] = []
    for rec in mine:
        start = mine[0]["_t"]
        prev = steps[-1].t if steps else rec["_t"]
        steps.append(Step(t=rec["_t"], since_start=rec["_t"] - start, gap=rec["_t"] - prev,
                          actor=str(rec.get("actor", "?")), event=rec["event"],
                          level=str(rec.get("level", "")), fields=fields(rec)))
    return steps
