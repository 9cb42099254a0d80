"""What a run did, from its records: requests by finish reason, latency percentiles (TTFT,
inter-token latency, end to end, queue), tokens in and out, the prefix cache's hit rate,
retractions, warnings and errors grouped by actor and event, the runner's busy fraction over
time, and the slowest requests. Pure: a list of records in, a JSON-ready dict out."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Iterable

from launch.logs.events import LEVELS, Record, in_order

PERCENTILES = (50, 90, 99)


@dataclass
class Request:
    """One request as its records tell it."""

    rid: str
    req_id: str | None = None
    received: float | None = None
    reason: str | None = None  # None: no end was logged (still open, or the log was cut)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    ttft_s: float | None = None
    total_s: float | None = None
    queue_s: float | None = None  # first admission
    retractions: int = 0
    chunks: int = 0
    error: str | None = None
    ended_by: str = ""  # the event that gave the end: request.finished, else request.ended

    @property
    def itl_s(self) -> float | None:
        """Mean time between output tokens after the first (vLLM's TPOT)."""
        if self.ttft_s is None or self.total_s is None or self.completion_tokens < 2:
            return None
        return (self.total_s - self.ttft_s) / (self.completion_tokens - 1)


def requests(records: Iterable[Record]) -> dict[str, Request]:
    """rid -> Request. The tokenizer's request.finished is the end a client saw (with TTFT and
    end-to-end time); the scheduler's request.ended stands in where it is missing."""
    found: dict[str, Request] = {}
    for rec in in_order(records):
        rid = rec.get("rid")
        if not rid or not rec["event"].startswith("request."):
            continue
        req = found.setdefault(rid, Request(rid))
        match rec["event"]:
            case "request.received":
                req.req_id, req.received = rec.get("req_id"), rec["_t"]
                req.prompt_tokens = rec.get("prompt_tokens") or req.prompt_tokens
            case "request.admitted" if req.queue_s is None:
                req.queue_s = rec.get("queue_s")
            case "request.retracted":
                req.retractions += 1
            case "request.prefill_chunk":
                req.chunks += 1
            case "request.finished":
                _end(req, rec)
                req.ttft_s, req.total_s = rec.get("ttft_s"), rec.get("total_s")
            case "request.ended" if req.ended_by != "request.finished":
                _end(req, rec)
    return found


def _end(req: Request, rec: Record) -> None:
    req.reason, req.ended_by = rec.get("reason"), rec["event"]
    req.prompt_tokens = rec.get("prompt_tokens") or req.prompt_tokens
    req.completion_tokens = rec.get("completion_tokens") or 0
    req.cached_tokens = rec.get("cached_tokens") or 0
    req.error = rec.get("error") or None


def percentiles(values: Iterable[float | None]) -> dict[str, float] | None:
    """count, mean, p50/p90/p99 (linear between closest ranks, as numpy) and max."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    out = {"count": len(xs), "mean": sum(xs) / len(xs)}
    for p in PERCENTILES:
        pos = (len(xs) - 1) * p / 100
        lo = int(pos)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
    out["max"] = xs[-1]
    return {k: (v if k == "count" else round(v, 6)) for k, v in out.items()}


def problems(records: Iterable[Record]) -> list[dict[str, Any]]:
    """Warnings and errors grouped by (level, actor, event), the most severe first, each with
    how many and the first one's message."""
    groups: dict[tuple[str, str, str], dict[str, Any]] = {}
    for rec in records:
        level = rec.get("level", "")
        if LEVELS.get(level, 0) < LEVELS["warning"]:
            continue
        key = (level, str(rec.get("actor", "?")), rec["event"])
        group = groups.setdefault(key, {"level": key[0], "actor": key[1], "event": key[2],
                                        "count": 0, "example": None})
        group["count"] += 1
        if group["example"] is None:
            group["example"] = next((str(rec[k])[:200] for k in ("error", "reason", "message")
                                     if rec.get(k)), None)
    return sorted(groups.values(), key=lambda g: (-LEVELS.get(g["level"], 0), -g["count"]))


def runner_busy(records: Iterable[Record], buckets: int = 12) -> dict[str, Any] | None:
    """From runner.utilisation (one per log.stats_interval_s while the runner has work): the
    busy fraction over the whole span, and per window of time. The runner logs nothing for an
    interval without a step, so a stretch with no record counts as idle."""
    stats = [r for r in records if r["event"] == "runner.utilisation"
             and r.get("wall_s") and r.get("busy_s") is not None]
    if not stats:
        return None
    stats = in_order(stats)
    start = min(r["_t"] - r["wall_s"] for r in stats)
    end = stats[-1]["_t"]
    n = max(1, min(buckets, len(stats)))
    width = (end - start) / n or 1.0
    rows = [{"start": start + i * width, "seconds": width, "busy_s": 0.0, "steps": 0,
             "tokens": 0.0} for i in range(n)]
    for rec in stats:  # an interval's numbers go to the windows it overlaps, pro rata
        lo, hi = rec["_t"] - rec["wall_s"], rec["_t"]
        for row in rows:
            share = (min(hi, row["start"] + width) - max(lo, row["start"])) / rec["wall_s"]
            if share > 0:
                row["busy_s"] += rec["busy_s"] * share
                row["steps"] += (rec.get("steps") or 0) * share
                row["tokens"] += (rec.get("tokens_per_s") or 0.0) * rec["wall_s"] * share
    over_time = [{"start": _iso(r["start"]), "seconds": round(r["seconds"], 3),
                  "busy_fraction": round(min(1.0, r["busy_s"] / r["seconds"]), 4),
                  "steps_per_s": round(r["steps"] / r["seconds"], 2),
                  "tokens_per_s": round(r["tokens"] / r["seconds"], 2)} for r in rows]
    busy = sum(r["busy_s"] for r in stats)
    return {"busy_fraction": round(min(1.0, busy / ((end - start) or 1.0)), 4),
            "busy_fraction_while_reporting": round(busy / sum(r["wall_s"] for r in stats), 4),
            "intervals": len(stats), "over_time": over_time}


def summarize(records: list[Record], slowest: int = 5, buckets: int = 12) -> dict[str, Any]:
    records = in_order(records)
    reqs = requests(records)
    ended = [r for r in reqs.values() if r.reason is not None]
    by_reason: dict[str, int] = {}
    for r in ended:
        by_reason[r.reason] = by_reason.get(r.reason, 0) + 1
    prompt = sum(r.prompt_tokens for r in ended)
    cached = sum(r.cached_tokens for r in ended)
    completion = sum(r.completion_tokens for r in ended)
    first = records[0]["_t"] if records else None
    last = records[-1]["_t"] if records else None
    span = (last - first) if records else 0.0
    actors: dict[str, int] = {}
    for rec in records:
        actors[str(rec.get("actor", "?"))] = actors.get(str(rec.get("actor", "?")), 0) + 1
    retracted = [r for r in reqs.values() if r.retractions]
    slow = sorted((r for r in ended if r.total_s is not None), key=lambda r: -r.total_s)
    return {
        "window": {"first": _iso(first), "last": _iso(last), "seconds": round(span, 3),
                   "records": len(records), "actors": actors},
        "requests": {"ended": len(ended), "by_reason": dict(sorted(by_reason.items())),
                     "open": sum(1 for r in reqs.values() if r.reason is None),
                     "rejected": sum(1 for r in records if r["event"] == "request.rejected"),
                     "chunked": sum(1 for r in reqs.values() if r.chunks > 1)},
        "latency_s": {"ttft": percentiles(r.ttft_s for r in ended),
                      "itl": percentiles(r.itl_s for r in ended),
                      "e2e": percentiles(r.total_s for r in ended),
                      "queue": percentiles(r.queue_s for r in reqs.values())},
        "tokens": {"prompt": prompt, "completion": completion, "cached": cached,
                   "completion_per_s": round(completion / span, 2) if span else None},
        "prefix_cache": {"hit_rate": round(cached / prompt, 4) if prompt else None,
                         "cached_tokens": cached, "prompt_tokens": prompt},
        "retractions": {"count": sum(r.retractions for r in retracted),
                        "requests": len(retracted)},
        "problems": problems(records),
        "runner": runner_busy(records, buckets),
        "slowest": [{"rid": r.rid, "req_id": r.req_id, "reason": r.reason,
                     "e2e_s": r.total_s, "ttft_s": r.ttft_s, "queue_s": r.queue_s,
                     "prompt_tokens": r.prompt_tokens, "completion_tokens": r.completion_tokens,
                     "retractions": r.retractions} for r in slow[:slowest]],
    }


def _iso(t: float | None) -> str | None:
    if t is None:
        return None
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="milliseconds")
