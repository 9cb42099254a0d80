"""The terminal side of `launch logs`: records, a timeline and a summary drawn with rich."""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Iterable

from rich.console import Console
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from launch.logs.events import Record, fields
from launch.logs.timeline import Step

LEVEL_STYLE = {"debug": "dim", "info": "green", "warning": "yellow", "error": "bold red",
               "critical": "bold red reverse"}


def clock(t: float) -> str:
    """Local wall-clock time with milliseconds."""
    return datetime.fromtimestamp(t).strftime("%H:%M:%S.%f")[:-3]


def _value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.6g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)


def details(values: dict[str, Any]) -> Text:
    text = Text()
    for k, v in values.items():
        if text:
            text.append(" ")
        text.append(f"{k}=", style="dim")
        text.append(_value(v))
    return text


def record_line(rec: Record) -> Text:
    """One record on one line: time, level, actor, event, rid, fields."""
    level = str(rec.get("level", ""))
    line = Text.assemble((clock(rec["_t"]), "dim"), " ",
                         (f"{level:<7}", LEVEL_STYLE.get(level, "")), " ",
                         (f"{str(rec.get('actor', '?')):<11}", "cyan"), " ",
                         (rec["event"], "bold"))
    if rec.get("rid"):
        line.append(f" {rec['rid']}", style="magenta")
    if extra := fields(rec):
        line.append(" ")
        line.append_text(details(extra))
    return line


def print_records(console: Console, records: Iterable[Record]) -> None:
    for rec in records:
        console.print(record_line(rec), soft_wrap=True)


def print_timeline(console: Console, rid: str, steps: list[Step]) -> None:
    table = Table(title=f"request {rid}", title_justify="left", expand=False)
    table.add_column("time", style="dim", no_wrap=True)
    table.add_column("+s", justify="right", no_wrap=True)
    table.add_column("gap ms", justify="right", no_wrap=True)
    table.add_column("actor", style="cyan", no_wrap=True)
    table.add_column("event", style="bold", no_wrap=True)
    table.add_column("details")
    for s in steps:
        table.add_row(clock(s.t), f"{s.since_start:.3f}", f"{s.gap * 1000:.1f}", s.actor,
                      Text(s.event, style=LEVEL_STYLE.get(s.level, "") if s.level != "info"
                           else ""), details(s.fields))
    console.print(table)


def _seconds(v: float | None) -> str:
    if v is None:
        return "-"
    return f"{v * 1000:.1f} ms" if v < 1 else f"{v:.3f} s"


def print_summary(console: Console, path: str, s: dict[str, Any]) -> None:
    w, req, tok = s["window"], s["requests"], s["tokens"]
    head = Table.grid(padding=(0, 2))
    head.add_column(style="dim")
    head.add_column()
    head.add_row("file", path)
    head.add_row("window", f"{w['first']} .. {w['last']} ({w['seconds']:.1f} s, "
                 f"{w['records']} records)")
    head.add_row("actors", ", ".join(f"{a} {n}" for a, n in sorted(w["actors"].items())))
    hit = s["prefix_cache"]["hit_rate"]
    head.add_row("tokens", f"{tok['prompt']} in, {tok['completion']} out, {tok['cached']} "
                 f"cached (prefix hit rate {'-' if hit is None else f'{hit:.1%}'})"
                 + (f", {tok['completion_per_s']:.1f} out/s" if tok["completion_per_s"]
                    else ""))
    head.add_row("retractions", f"{s['retractions']['count']} "
                 f"({s['retractions']['requests']} requests)")
    console.print(Panel(head, title="mlx-actor-serve log", title_align="left"))

    reasons = Table(title="requests", title_justify="left")
    reasons.add_column("finish reason")
    reasons.add_column("requests", justify="right")
    for reason, n in req["by_reason"].items():
        reasons.add_row(reason, str(n), style="red" if reason == "error" else None)
    reasons.add_row("total ended", str(req["ended"]), style="bold")
    for name in ("open", "rejected", "chunked"):
        if req[name]:
            reasons.add_row(name if name != "chunked" else "chunked (of all)", str(req[name]),
                            style="dim")

    lat = Table(title="latency", title_justify="left")
    lat.add_column("")
    for col in ("n", "mean", "p50", "p90", "p99", "max"):
        lat.add_column(col, justify="right")
    names = {"ttft": "time to first token", "itl": "inter-token (per request)",
             "e2e": "end to end", "queue": "queue (first admission)"}
    for key, label in names.items():
        p = s["latency_s"][key]
        if p:
            lat.add_row(label, str(p["count"]), *(_seconds(p[c]) for c in
                                                  ("mean", "p50", "p90", "p99", "max")))
    console.print(_side_by_side(reasons, lat))

    if s["problems"]:
        prob = Table(title="warnings and errors", title_justify="left")
        for col in ("level", "actor", "event", "count", "first message"):
            prob.add_column(col, justify="right" if col == "count" else "left")
        for p in s["problems"]:
            prob.add_row(Text(p["level"], style=LEVEL_STYLE.get(p["level"], "")), p["actor"],
                         p["event"], str(p["count"]), p["example"] or "")
        console.print(prob)

    if s["runner"]:
        r = s["runner"]
        busy = Table(title=f"runner busy {r['busy_fraction']:.0%} of its span "
                     f"({r['busy_fraction_while_reporting']:.0%} of reported intervals)",
                     title_justify="left")
        for col in ("from (UTC)", "s", "busy", "", "steps/s", "tokens/s"):
            busy.add_column(col, justify="left" if col in ("from (UTC)", "") else "right")
        for row in r["over_time"]:
            busy.add_row(row["start"][11:23], f"{row['seconds']:.1f}",
                         f"{row['busy_fraction']:.0%}",
                         ProgressBar(total=1.0, completed=row["busy_fraction"], width=24),
                         f"{row['steps_per_s']:.1f}", f"{row['tokens_per_s']:.1f}")
        console.print(busy)

    if s["slowest"]:
        slow = Table(title="slowest requests", title_justify="left")
        for col in ("rid", "req_id", "reason", "e2e", "ttft", "queue", "in", "out",
                    "retracted"):
            slow.add_column(col, justify="left" if col in ("rid", "req_id", "reason")
                            else "right", no_wrap=col == "rid")
        for r in s["slowest"]:
            slow.add_row(r["rid"], str(r["req_id"] or ""), str(r["reason"]),
                         _seconds(r["e2e_s"]), _seconds(r["ttft_s"]), _seconds(r["queue_s"]),
                         str(r["prompt_tokens"]), str(r["completion_tokens"]),
                         str(r["retractions"] or ""))
        console.print(slow)


def _side_by_side(*tables: Table) -> Table:
    grid = Table.grid(padding=(0, 4))
    for _ in tables:
        grid.add_column(vertical="top")
    grid.add_row(*tables)
    return grid
