"""Fuzz + soak job: no input from any client may take the server down.

    python -m tools.fuzz [--model qwen3-tiny] [--scale 1.0] [--seed 0]
                              [--report PATH] [--restarts 0]

Against a real graph on a built-in model, its JSON logs going to a file that the job reads
back (actor pids, scheduler.idle and scheduler.leak records, crash records):

1. fuzz: 10,000 ZMQ frames (frames.py) and 10,000 HTTP bodies (bodies.py): hypothesis
   strategies from the servers' msgspec schemas, invalid UTF-8, deep nesting, huge values, byte
   mutations of valid requests, each with the verdict the server must reach (cases.py), sent
   over a few connections at a time (clients.py);
2. soak: 5,000 valid mixed requests at concurrency 16 over both APIs, with aborts, dropped HTTP
   connections and ZMQ sockets closed mid-request (soak.py), and a greedy
   canary before, during and after whose token ids must never change;
3. the end: every actor alive, the scheduler idle with nothing leaked, the runner's RSS within
   its band, exit code 0 after SIGINT.

Writes a JSON report (the first offending inputs of each failure kind, as repr of their
bytes) and prints a table; exits 1 naming each criterion that failed. When the graph dies the
phase stops at once and the report names the inputs in flight; --restarts N starts a new graph
and goes on (to find more than one kind of crash in one run; the crash still fails the run).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

from tools.fuzz import bodies, frames
from tools.fuzz.cases import Values, cases
from tools.fuzz.clients import Feed, Tally, http_fuzz, zmq_fuzz
from tools.fuzz.watch import Graph, start
from tools.fuzz.soak import canary, soak
from harness.graph import alive, stop_graph


class Job:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="fuzz-"))
        self.graph: Graph | None = None
        self.graphs = 0
        self.restarts_left = args.restarts
        self.report: dict[str, Any] = {"model": args.model, "seed": args.seed, "crashes": [],
                                       "canary": [], "log_files": []}

    # -- the graph ------------------------------------------------------------------------

    async def start(self) -> None:
        path = self.log_dir / f"graph-{self.graphs}.jsonl"
        self.graphs += 1
        self.report["log_files"].append(str(path))
        kv = [f"memory.kv_tokens={self.args.kv_tokens}"] if self.args.kv_tokens else []
        self.graph = await asyncio.to_thread(start, self.args.model, path, *kv)
        self.say(f"graph up: {self.graph.started.client} {self.graph.started.http}, "
                 f"pids {self.graph.pids()}, log {path}")

    async def guarded(self, work: Awaitable, progress: Callable[[], str]) -> str:
        """Run `work` while watching the graph: "" when it ended, else why the graph died
        (the work is cancelled then: one crash must not hang the job)."""
        task = asyncio.ensure_future(work)
        said = time.monotonic()
        while not task.done():
            await asyncio.wait({task}, timeout=0.25)
            if not task.done() and (why := self.graph.problem()):
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                return why
            if time.monotonic() - said > self.args.progress_s:
                said = time.monotonic()
                self.say(progress())
        task.result()  # a bug in the job itself is raised, not hidden
        return ""

    async def crashed(self, phase: str, why: str, inflight: dict, done: int) -> bool:
        """Record a crash with the inputs in flight (one of them did it); True when a new
        graph was started to go on."""
        await asyncio.sleep(1.0)  # the crash records reach the log file
        suspects = [case.show() for _, case in sorted(inflight.values(), key=lambda x: x[0])]
        why = self.graph.first_failure() or why
        self.report["crashes"].append({"phase": phase, "reason": why, "after_cases": done,
                                       "in_flight": suspects,
                                       "log": self.graph.crash_records()})
        inflight.clear()
        self.say(f"GRAPH DOWN during {phase} after {done} cases: {why[:300]}; "
                 f"{len(suspects)} in flight, first: {suspects[:1]!s:.300}")
        await asyncio.to_thread(stop_graph, self.graph.started.proc, 30)
        if self.restarts_left <= 0:
            return False
        self.restarts_left -= 1
        await self.start()
        return True

    # -- phases ---------------------------------------------------------------------------

    def inputs(self) -> tuple[frames.Frames, bodies.Bodies]:
        from models.builtin import ensure_builtin
        from models.info import read_model_info
        from models.tokenizer import load_tokenizer

        path = str(ensure_builtin(self.args.model, progress=False))
        info, tokenizer = read_model_info(path), load_tokenizer(path)
        count = functools.lru_cache(maxsize=64)(lambda text: len(tokenizer.encode(text)))
        model = (info.vocab_size, info.context_length, count)
        return frames.Frames(*model), bodies.Bodies(*model)

    async def fuzz(self, surface: str, n: int, inputs: Values) -> None:
        tally, inflight = Tally(), {}
        self.report[surface] = tally.report()
        if n <= 0 or self.graph.problem():
            return
        strategy = inputs.case()
        finish = frames.finish if surface == "zmq" else bodies.finish
        feed = Feed(lambda: cases(strategy, finish, n, self.args.seed))
        a, begun = self.args, time.monotonic()
        try:
            while True:
                work = (zmq_fuzz(self.graph.started.client, feed, tally, inflight, a.conns,
                                 a.timeout) if surface == "zmq" else
                        http_fuzz(self.graph.started.http, feed, tally, inflight, a.conns,
                                  a.timeout))
                why = await self.guarded(work, lambda: f"{surface} fuzz: {tally.cases}/{n} "
                                         f"cases, failures {_counts(tally)}")
                if not why or not await self.crashed(surface, why, inflight, tally.cases):
                    break
        finally:
            feed.close()
        self.report[surface] = {**tally.report(), "duration_s": round(time.monotonic() - begun)}
        self.say(f"{surface} fuzz done: {tally.cases} cases, failures {_counts(tally)}")

    async def soak(self) -> None:
        a = self.args
        n, tally = a.soak_requests, Tally()
        self.report["soak"] = {"requests": 0, "tally": tally.report()}
        if n <= 0 or self.graph.problem():
            return
        warm = min(n, max(4 * a.concurrency, n // 10))
        begun = time.monotonic()
        g = self.graph

        def run(indices: range) -> Awaitable:
            return soak(g.started.client, g.started.http, indices, a.seed, a.concurrency, tally,
                        a.request_timeout)

        progress = lambda: f"soak: {tally.cases}/{n} requests, failures {_counts(tally)}"  # noqa
        await self.canary("soak start")
        why = await self.guarded(run(range(warm)), progress)
        samples: list[tuple[float, float | None]] = []
        if not why:
            side = asyncio.ensure_future(self.sample(samples))
            why = await self.guarded(run(range(warm, n)), progress)
            side.cancel()
            await asyncio.gather(side, return_exceptions=True)
            samples.append((round(time.monotonic() - begun, 1), g.rss_mib()))
        if why:  # no restart: the end checks are about this graph
            self.restarts_left = 0
            await self.crashed("soak", why, {}, tally.cases)
        self.report["rss"] = rss_floor(samples) if not why else {}
        self.report["soak"] = {"requests": tally.cases, "warmup": warm,
                               "concurrency": a.concurrency,
                               "duration_s": round(time.monotonic() - begun), "tally":
                               tally.report(), **_soak_counts(tally)}
        self.say(f"soak done: {tally.cases} requests, failures {_counts(tally)}")

    async def sample(self, samples: list) -> None:
        """After the warm-up: the runner's RSS every second, the canary every canary_every_s."""
        begun = next_canary = time.monotonic()
        while True:
            t = time.monotonic() - begun
            samples.append((round(t, 1), self.graph.rss_mib()))
            if time.monotonic() >= next_canary + self.args.canary_every_s:
                next_canary = time.monotonic()
                await self.canary(f"soak +{t:.0f}s")
            await asyncio.sleep(1.0)

    async def canary(self, label: str) -> None:
        got = await canary(self.graph.started.client, len(self.report["canary"]))
        self.report["canary"].append({"when": label, "graph": self.graphs - 1, "tokens": got})

    async def finish(self) -> None:
        """Idle with nothing leaked after the last request, then a clean exit on SIGINT."""
        g, end = self.graph, {}
        self.report["end"] = end
        end["problem"] = g.problem()
        if not end["problem"]:
            await asyncio.sleep(0.5)  # idle records of the soak's end reach the file first
            idle_before = len(g.log.events("scheduler.idle"))
            await self.canary("end")
            deadline = time.monotonic() + 30
            while len(g.log.events("scheduler.idle")) <= idle_before and \
                    time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            idle = g.log.events("scheduler.idle")
            end["idle_after_last_request"] = len(idle) > idle_before
            if idle:
                end["first_idle"] = {k: idle[0].get(k) for k in ("free_rows", "free_slots")}
                end["last_idle"] = {k: idle[-1].get(k) for k in ("free_rows", "free_slots")}
        end["leaks"] = [json.dumps(r)[:600] for r in g.log.events("scheduler.leak")]
        pids = list(g.pids().values())
        await asyncio.to_thread(stop_graph, g.started.proc, 60)
        end["exit_code"] = g.started.proc.returncode
        deadline = time.monotonic() + 20
        while any(map(alive, pids)) and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        end["pids_left"] = [p for p in pids if alive(p)]
        end["server_errors_logged"] = len(g.log.events("http.error"))

    async def run(self) -> dict[str, Any]:
        a, begun = self.args, time.monotonic()
        zmq_inputs, http_inputs = await asyncio.to_thread(self.inputs)
        await self.start()
        try:
            await self.canary("start")
            await self.fuzz("zmq", a.zmq_cases, zmq_inputs)
            await self.fuzz("http", a.http_cases, http_inputs)
            await self.soak()
            await self.finish()
        finally:
            if self.graph.started.proc.poll() is None:  # the job failed: no graph left behind
                await asyncio.to_thread(stop_graph, self.graph.started.proc, 30)
        self.report["duration_s"] = round(time.monotonic() - begun)
        self.report["criteria"] = criteria(self.report, a)
        self.report["failed"] = [c["name"] for c in self.report["criteria"] if not c["ok"]]
        return self.report

    def say(self, text: str) -> None:
        if not self.args.quiet:
            print(f"[fuzz {time.strftime('%H:%M:%S')}] {text}", file=sys.stderr,
                  flush=True)


def rss_floor(samples: list[tuple[float, float | None]]) -> dict[str, Any]:
    """RSS swings by tens of MiB as a step's arrays come and go; a leak raises its floor. Start
    and end: the lowest sample of the first and of the last quarter after the warm-up. The
    floor of each quarter tells a leak (a climb) from a high-water step (one rise, then flat)."""
    values = [v for _, v in samples if v is not None]
    if not values:
        return {}
    q = max(1, len(values) // 4)
    quarters = [round(min(values[k:k + q]), 1) for k in range(0, len(values), q)][:4]
    return {"start_mib": min(values[:q]), "end_mib": min(values[-q:]), "peak_mib": max(values),
            "quarter_floors_mib": quarters, "samples": len(values),
            "every_10th": [(t, round(v)) for t, v in samples[::10] if v is not None]}


def _counts(tally: Tally) -> dict[str, int]:
    return {k: v["count"] for k, v in tally.failures.items()}


def _soak_counts(tally: Tally) -> dict[str, int]:
    """Aborts and clients that left, per API, from the per-kind outcomes."""
    def total(api: str, outcome: str) -> int:
        return sum(c.get(outcome, 0) for k, c in tally.by_kind.items() if k.startswith(api))
    return {"zmq_requests": sum(sum(c.values()) for k, c in tally.by_kind.items()
                                if k.startswith("zmq")) - total("zmq", "abort_sent"),
            "http_requests": sum(sum(c.values()) for k, c in tally.by_kind.items()
                                 if k.startswith("http")),
            "aborts": total("zmq", "abort_sent"), "zmq_disconnects": total("zmq", "client_left"),
            "http_closed": total("http", "client_left")}


# -- criteria and report ------------------------------------------------------------------------


def _none_of(report: dict, section: str, names: tuple[str, ...]) -> tuple[bool, str]:
    tally = report.get(section, {})
    tally = tally.get("tally", tally)
    found = {n: tally.get("failures", {}).get(n) for n in names}
    found = {n: f for n, f in found.items() if f}
    if not found:
        return True, "none"
    name, first = next(iter(found.items()))
    return False, (", ".join(f"{n}: {f['count']}" for n, f in found.items())
                   + f"; first: {first['examples'][0][:300]}")


def criteria(report: dict, args: argparse.Namespace) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []

    def check(name: str, ok: bool, detail: str) -> None:
        out.append({"name": name, "ok": bool(ok), "detail": detail})

    crashes, end = report["crashes"], report.get("end", {})
    check("graph_up", not crashes and not end.get("problem"),
          "; ".join(f"{c['phase']}: {c['reason']} (in flight: {c['in_flight'][:1]})"
                    for c in crashes) or end.get("problem") or "all 4 actors and the launcher up")
    ran = {s: report.get(s, {}).get("cases", 0) >= n for s, n in
           (("zmq", args.zmq_cases), ("http", args.http_cases))}
    soaked = report.get("soak", {}).get("requests", 0) >= args.soak_requests
    for name, section, names, done in (
            ("zmq_no_5xx", "zmq", ("zmq_5xx",), ran["zmq"]),
            ("zmq_one_terminal_reply", "zmq", ("zmq_no_reply", "zmq_duplicate_reply",
                                               "zmq_wrong_req_id", "zmq_bad_reply"), ran["zmq"]),
            ("http_no_5xx", "http", ("http_5xx",), ran["http"]),
            ("http_answered", "http", ("http_no_reply", "http_connection",
                                       "http_stream_unterminated"), ran["http"]),
            ("soak_one_terminal_outcome", "soak", ("soak_no_terminal", "soak_duplicate_reply",
                                                   "soak_stream_end", "soak_connection"), soaked),
            ("soak_served", "soak", ("soak_error", "soak_wrong_result", "soak_unasked_abort"),
             soaked)):
        ok, detail = _none_of(report, section, names)
        check(name, ok and done, detail if done else f"not run to the end; {detail}")
    for name, kind in (("invalid_refused", "invalid_served"), ("valid_served", "valid_refused")):
        results = [_none_of(report, s, (kind,)) for s in ("zmq", "http")]
        check(name, all(ok for ok, _ in results) and all(ran.values()),
              " | ".join(f"{s}: {d}" for s, (_, d) in zip(("zmq", "http"), results)))
    runs = [c["tokens"] for c in report["canary"]]
    same = bool(runs) and all(isinstance(r, list) and r == runs[0] for r in runs)
    check("canary_stable", same, f"{len(runs)} runs" + ("" if same else f": {runs}"))
    first, last = end.get("first_idle", {}), end.get("last_idle", {})
    check("idle_after_last_request", end.get("idle_after_last_request", False),
          f"last scheduler.idle {last}")
    # Free KV slots end lower than they began: the prefix cache holds them (the scheduler's
    # own check, scheduler.leak, counts those as held, and names any slot that is neither).
    rows_back = first.get("free_rows") is not None and first["free_rows"] == last["free_rows"]
    check("no_leak", not end.get("leaks") and rows_back,
          f"scheduler.leak records: {end.get('leaks', [])[:2]}; free rows "
          f"{first.get('free_rows')} -> {last.get('free_rows')}, free KV slots "
          f"{first.get('free_slots')} -> {last.get('free_slots')} (the rest cached)")
    rss = report.get("rss", {})
    s, e = rss.get("start_mib"), rss.get("end_mib")
    band = max(args.rss_band_pct / 100 * (s or 0), args.rss_band_mib)
    check("rss_band", s is not None and e is not None and e - s <= band,
          f"runner RSS floor {s and round(s, 1)} -> {e and round(e, 1)} MiB (by quarter "
          f"{rss.get('quarter_floors_mib')}, peak {_mib(rss.get('peak_mib'))}), band "
          f"+{band:.0f} MiB (+{args.rss_band_pct:g}% or +{args.rss_band_mib:g} MiB, the larger)")
    check("clean_exit", end.get("exit_code") == 0 and not end.get("pids_left"),
          f"exit code {end.get('exit_code')} after SIGINT, pids left {end.get('pids_left')}")
    return out


def table(report: dict) -> str:
    lines = [f"fuzz + soak on {report['model']}, {report['duration_s']} s, "
             f"log {', '.join(report['log_files'])}"]
    for surface in ("zmq", "http"):
        t = report.get(surface, {})
        top = sorted(t.get("outcomes", {}).items(), key=lambda kv: -kv[1])[:8]
        lines.append(f"  {surface:5} {t.get('cases', 0):6} cases  "
                     + ", ".join(f"{k} {v}" for k, v in top))
    sk = report.get("soak", {})
    lines.append(f"  soak  {sk.get('requests', 0):6} requests (zmq {sk.get('zmq_requests', 0)}, "
                 f"http {sk.get('http_requests', 0)}) at concurrency {sk.get('concurrency')}, "
                 f"{sk.get('duration_s')} s: aborts {sk.get('aborts', 0)}, zmq disconnects "
                 f"{sk.get('zmq_disconnects', 0)}, http closed {sk.get('http_closed', 0)}")
    end, rss = report.get("end", {}), report.get("rss", {})
    lines.append(f"  canary {len(report['canary'])} runs; runner RSS floor "
                 f"{_mib(rss.get('start_mib'))} -> {_mib(rss.get('end_mib'))} (peak "
                 f"{_mib(rss.get('peak_mib'))}); idle {end.get('first_idle')} -> "
                 f"{end.get('last_idle')}; exit code {end.get('exit_code')}")
    for c in report["crashes"]:
        lines.append(f"  CRASH in {c['phase']} after {c['after_cases']}: {c['reason']}")
    for c in report["criteria"]:
        lines.append(f"  {'PASS' if c['ok'] else 'FAIL'} {c['name']}: {c['detail'][:240]}")
    return "\n".join(lines)


def _mib(v: float | None) -> str:
    return "?" if v is None else f"{v:.1f} MiB"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m tools.fuzz",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-tiny", help="built-in model name")
    p.add_argument("--scale", type=float, default=1.0,
                   help="multiplies the three counts below (0.05 for a quick run)")
    p.add_argument("--zmq-cases", type=int, default=10_000)
    p.add_argument("--http-cases", type=int, default=10_000)
    p.add_argument("--soak-requests", type=int, default=5_000)
    p.add_argument("--concurrency", type=int, default=16, help="soak workers")
    p.add_argument("--conns", type=int, default=4, help="fuzz connections per surface")
    p.add_argument("--timeout", type=float, default=30.0, help="per fuzz case, seconds")
    p.add_argument("--request-timeout", type=float, default=120.0,
                   help="per soak request, seconds")
    p.add_argument("--canary-every-s", type=float, default=30.0)
    p.add_argument("--kv-tokens", type=int, default=16384,
                   help="the graph's KV pool (memory.kv_tokens; 0: the server's default): "
                        "small, so the prefix cache fills, evicts and retracts within the run "
                        "and the runner's RSS reaches its plateau in the warm-up")
    # Measured on qwen3-tiny: the floor can rise once by ~100 MiB (~30%) when a rare mix of
    # large shapes meets, then stays flat; a leak of 26 KB a request still passes 128 MiB over
    # 5,000 requests. The quarter floors in the report show which one it was.
    p.add_argument("--rss-band-pct", type=float, default=50.0)
    p.add_argument("--rss-band-mib", type=float, default=128.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--restarts", type=int, default=0,
                   help="after a crash in fuzzing, start a new graph and go on (N times)")
    p.add_argument("--report", default="", help="JSON report path (report.json in the log dir)")
    p.add_argument("--log-dir", default="", help="where the graph's logs go (a temp dir)")
    p.add_argument("--progress-s", type=float, default=15.0)
    p.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    for name in ("zmq_cases", "http_cases", "soak_requests"):
        setattr(args, name, round(getattr(args, name) * args.scale))
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole job; the report (report["failed"] names the failed criteria)."""
    return asyncio.run(Job(args).run())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.log_dir = args.log_dir or tempfile.mkdtemp(prefix="fuzz-")
    report = run(args)
    path = Path(args.report or Path(args.log_dir) / "report.json")
    path.write_text(json.dumps(report, indent=1, default=str))
    print(table(report))
    print(f"report: {path}")
    if report["failed"]:
        print(f"FAILED: {', '.join(report['failed'])}")
        return 1
    return 0

