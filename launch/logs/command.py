"""`launch logs [FILE] [--rid RID | --list | --follow] [filters] [--json]`.

    launch logs                          summary of the newest run in log.dir
    launch logs FILE --rid r-12          one request's timeline (a client req_id works too)
    launch logs FILE --list --level warning --event 'request.*'
    launch logs FILE --follow --actor scheduler     tail -F, filtered
    launch logs FILE --since +30s --until +90s --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from launch.logs.events import LEVELS, Filter, Record, parse_when, select
from launch.logs.files import latest_run
from protocol.config import LogConfig

ACTORS = ("launcher", "tokenizer", "scheduler", "runner", "detokenizer")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="launch logs", description="Read a run's JSON-lines log: a summary (default), one "
        "request's timeline (--rid), or the records themselves (--list, --follow).",
        epilog="Times for --since/--until: 10m or 90s (before now), +30s (after the log's "
        "first record), 14:05:30 (local clock), or an ISO date-time.")
    p.add_argument("file", nargs="?", help="a run's log file, or a log folder (its newest "
                   f"run); default: the newest run in {LogConfig().dir}")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--rid", help="the timeline of one request (its rid, or its req_id)")
    view.add_argument("--list", action="store_true", help="list the records that match")
    p.add_argument("--follow", "-f", action="store_true",
                   help="keep printing matching records as they are written (tail -F)")
    p.add_argument("--since", help="only records at or after this time")
    p.add_argument("--until", help="only records at or before this time")
    p.add_argument("--actor", action="append", default=[],
                   help=f"only these actors (repeatable or comma separated): {', '.join(ACTORS)}")
    p.add_argument("--level", choices=list(LEVELS), help="only records at least this severe")
    p.add_argument("--event", help="only events matching this glob (request.*, *.failed)")
    p.add_argument("--rid-prefix", help="only records whose rid starts with this")
    p.add_argument("--json", action="store_true", help="machine-readable output (a summary or "
                   "timelines as JSON; records as JSON lines)")
    p.add_argument("--slowest", type=int, default=5, help="slowest requests in the summary")
    p.add_argument("--no-backups", action="store_true",
                   help="read FILE only, not its rotated backups FILE.1 ...")
    return p.parse_args(argv)


def resolve_file(arg: str | None) -> Path:
    """FILE, the newest run in a folder, or the newest run in the default log.dir."""
    target = Path(arg).expanduser() if arg else Path(LogConfig().dir).expanduser()
    if target.is_dir():
        found = latest_run(target)
        if found is None:
            raise FileNotFoundError(f"no run log in {target}")
        return found
    if not target.exists():
        raise FileNotFoundError(f"{target}: no such file")
    return target


def make_filter(args: argparse.Namespace, records: list[Record], now: float) -> Filter:
    start = records[0]["_t"] if records else None
    actors = tuple(a.strip() for arg in args.actor for a in arg.split(",") if a.strip())
    return Filter(since=parse_when(args.since, now, start) if args.since else None,
                  until=parse_when(args.until, now, start) if args.until else None,
                  actors=actors, level=args.level, event=args.event,
                  rid_prefix=args.rid_prefix)


def plain(rec: Record) -> dict[str, Any]:
    return {k: v for k, v in rec.items() if not k.startswith("_")}


def console():
    from rich.console import Console

    out = Console(highlight=False)
    if not out.is_terminal and "COLUMNS" not in os.environ:
        out.width = 160  # a pipe or a file: wide enough for the tables, not 80
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from launch.logs.read import first_record, follow, read_records

    try:
        path = resolve_file(args.file)
        # Following needs only the first record (for --since +30s), not the whole file.
        records = first_record(path) if args.follow else read_records(
            path, with_backups=not args.no_backups)
        keep = make_filter(args, records, time.time())
    except (OSError, ValueError) as e:
        print(f"launch logs: {e}", file=sys.stderr)
        return 2
    if args.follow:
        return _follow(args, path, keep, follow)
    records = select(records, keep)
    if args.rid:
        return _timelines(args, records)
    if args.list:
        _list(args, records)
        return 0
    from launch.logs.summary import summarize

    summary = summarize(records, slowest=args.slowest)
    if args.json:
        print(json.dumps({"file": str(path), **summary}, indent=2))
    else:
        from launch.logs.show import print_summary

        print_summary(console(), str(path), summary)
    return 0


def _list(args: argparse.Namespace, records: list[Record]) -> None:
    if args.json:
        for rec in records:
            print(json.dumps(plain(rec), ensure_ascii=False))
        return
    from launch.logs.show import print_records

    print_records(console(), records)


def _timelines(args: argparse.Namespace, records: list[Record]) -> int:
    from launch.logs.timeline import find_rids, timeline

    rids = find_rids(records, args.rid)
    if not rids:
        print(f"launch logs: no request {args.rid!r} (as rid or req_id) in what was read",
              file=sys.stderr)
        return 1
    found = []
    for rid in rids:
        req_id = next((r.get("req_id") for r in records
                       if r.get("rid") == rid and r.get("req_id")), None)
        found.append((rid, req_id, timeline(records, rid)))
    if args.json:
        print(json.dumps([{"rid": rid, "req_id": req_id, "steps": [s.as_dict() for s in steps]}
                          for rid, req_id, steps in found], indent=2, ensure_ascii=False))
        return 0
    from launch.logs.show import print_timeline

    out = console()
    for rid, req_id, steps in found:
        print_timeline(out, rid if not req_id else f"{rid} (req_id {req_id})", steps)
    return 0


def _follow(args: argparse.Namespace, path: Path, keep: Filter, follow) -> int:
    if args.rid:
        keep = replace(keep, rid=args.rid)
    from launch.logs.show import record_line

    out = None if args.json else console()
    try:
        for rec in follow(path):
            if not keep(rec):
                continue
            if out is None:
                print(json.dumps(plain(rec), ensure_ascii=False), flush=True)
            else:
                out.print(record_line(rec), soft_wrap=True)
    except KeyboardInterrupt:
        pass
    return 0
