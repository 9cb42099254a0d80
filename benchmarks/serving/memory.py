"""What the runner holds under a KV budget far below the load: its RSS and MLX's memory
through waves of long prompts, against the budget memory.kv_tokens sets.

    python -m benchmarks.serving.memory [--model qwen3-small | --model-path DIR]
        [--kv-tokens 8192] [--clients 48] [--waves 3] [--prompt-tokens 900]
        [--shared-prefix 500] [--output-tokens 32] [--json PATH] [--log PATH]

The graph serves the model with memory.kv_tokens = kv_tokens (the budget: kv_tokens times the
model's KV bytes per token; 128 MiB for qwen3-small's float32 16 KiB a token at 8,192) and
log.stats_interval_s = 0.5. Then `waves` waves, one after another, of `clients` streamed
/v1/completions requests sent at once, each prompt_tokens words in and exactly output_tokens
tokens out. The second wave's prompts begin with the same shared_prefix tokens; every other
prompt is distinct. Measured:
- the runner's RSS (/proc/<pid>/status VmRSS) after the ready line and after each wave, its
  peak sampled every 0.1 s during each wave, and VmHWM (its peak since it started);
- from the run's JSON log: runner.ready's pool (kv_pages, kv_page_tokens, kv_pool_pages,
  kv_pool_mib, kv_slots), runner.weights (the weights as stored plus float32 copies), and
  runner.utilisation's MLX active and cache memory and pool size (its last record, its peaks);
- per wave: requests served, wall time, mean TTFT; for the shared-prefix wave, the TTFT of
  the requests that hit the prefix cache against the wave's first request.
MLX's active memory less the weights is the pool plus the step's live arrays; over the
budget it is at most 1.1 when the budget bounds what the runner holds. Exits 1 when a
request was not served.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.serving.crowd import actor_pids
from benchmarks.serving.load import PromptMaker, Sample, Target, closed_loop, summarize
from benchmarks.serving.run import add_model_args, machine, resolve_model
from benchmarks.serving.servers import ours

MIB = 2**20
READY_FIELDS = ("max_running_requests", "kv_pages", "kv_page_tokens", "kv_pool_pages",
                "kv_pool_mib", "kv_slots", "workspace_mib")
STATS_FIELDS = ("mlx_active_mib", "mlx_cache_mib", "kv_pool_pages", "kv_pool_mib")
LIMIT = 1.1  # (MLX active - weights) / budget the issue allows


def vm_mib(pid: int) -> dict[str, float]:
    """VmRSS (resident now) and VmHWM (the peak since the process started), in MiB."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key] = round(int(value.split()[0]) / 1024, 1)
    return out


class PeakRss:
    """VmRSS sampled from a thread while a wave runs (the clients' event loop is busy)."""

    def __init__(self, pid: int, every_s: float = 0.1):
        self.pid, self.every_s, self.peak = pid, every_s, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, vm_mib(self.pid)["VmRSS"])
            self._stop.wait(self.every_s)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def make_waves(maker: PromptMaker, args: argparse.Namespace) -> list[list[str]]:
    """Distinct prompts per wave; the second wave's begin with one shared prefix."""
    n, shared = args.prompt_tokens, min(args.shared_prefix, args.prompt_tokens)
    waves = []
    for w in range(args.waves):
        seeds = range(10_000 * (w + 1), 10_000 * (w + 1) + args.clients)
        if w == 1 and shared:
            prefix = maker.make(shared, seed=7)
            waves.append([prefix + maker.make(n - shared, seed=s) if n > shared else prefix
                          for s in seeds])
        else:
            waves.append([maker.make(n, seed=s) for s in seeds])
    return waves


def mean(values: list[float]) -> float | None:
    values = [v for v in values if v == v]
    return round(statistics.fmean(values), 3) if values else None


def wave_row(w: int, samples: list[Sample], wall: float, clients: int) -> dict[str, Any]:
    s = summarize(samples, wall, clients)
    ok = [x for x in samples if not x.error and x.chunks]
    row = {"wave": w + 1, "shared_prefix": w == 1, "requests": s["requests"], "ok": len(ok),
           "first_error": s["first_error"], "wall_s": round(wall, 2),
           "output_tokens": s["output_tokens"], "ttft_mean_s": mean([x.ttft for x in ok]),
           "ttft_p50_s": round(s["ttft_p50_s"], 3),
           "cached_tokens_mean": mean([x.cached_tokens for x in ok])}
    if w == 1:
        hits = [x for x in ok if x.cached_tokens]
        row.update(first_ttft_s=round(samples[0].ttft, 3), hits=len(hits),
                   hit_ttft_mean_s=mean([x.ttft for x in hits]),
                   miss_ttft_mean_s=mean([x.ttft for x in ok if not x.cached_tokens]))
    return row


async def drive(target: Target, runner: int, waves: list[list[str]],
                args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for w, prompts in enumerate(waves):
        start = time.time()
        with PeakRss(runner) as rss:
            samples, wall = await closed_loop(target, prompts, args.clients, args.output_tokens)
        after = vm_mib(runner)
        row = wave_row(w, samples, wall, args.clients)
        row.update(start=start, end=time.time(), rss_peak_mib=max(rss.peak, after["VmRSS"]),
                   rss_after_mib=after["VmRSS"], hwm_mib=after["VmHWM"])
        print(f"memory: wave {w + 1}: {row['ok']}/{row['requests']} ok in {wall:.1f} s, RSS "
              f"peak {row['rss_peak_mib']:.0f} MiB", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


def read_log(path: Path) -> list[dict[str, Any]]:
    from launch.logs.read import read_records

    return read_records(path)


def wait_for(path: Path, event: str, timeout: float = 30) -> dict[str, Any]:
    """The first `event` record of the run's log (records reach the file after the ready line)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [r for r in read_log(path) if r["event"] == event] if path.exists() else []
        if found or time.monotonic() > deadline:
            return found[0] if found else {}
        time.sleep(0.2)


def from_log(records: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
    stats = [r for r in records if r["event"] == "runner.utilisation"
             and r.get("actor") == "runner"]
    for row in rows:  # the records each wave's time span holds
        inside = [r for r in stats if row["start"] <= r["_t"] <= row["end"] + 1]
        row["mlx_active_max_mib"] = max((r["mlx_active_mib"] for r in inside), default=None)
        row["kv_pool_pages_max"] = max((r.get("kv_pool_pages", 0) for r in inside), default=None)
    last = stats[-1] if stats else {}
    loud = Counter(r["event"] for r in records
                   if r.get("level") in ("warning", "error", "critical"))
    return {"utilisation_records": len(stats),
            "last_utilisation": {k: last.get(k) for k in STATS_FIELDS},
            "mlx_active_max_mib": max((r["mlx_active_mib"] for r in stats), default=None),
            "mlx_cache_max_mib": max((r["mlx_cache_mib"] for r in stats), default=None),
            "kv_pool_pages_max": max((r.get("kv_pool_pages", 0) for r in stats), default=None),
            "warnings": dict(loud)}


def weights_mib(weights: dict[str, Any], blas: dict[str, Any], model_dir: str) -> float:
    """The weights MLX holds: as stored plus any float32 copies (runner.weights) and the
    greedy head's int8 copy of the LM head (runner.blas); without the weights record, the
    safetensors files' sizes."""
    head = blas.get("greedy_head_mib") or 0
    if weights.get("stored_mib") is not None:
        return round(weights["stored_mib"] + weights.get("resident_mib", 0) + head, 1)
    size = sum(f.stat().st_size for f in Path(model_dir).glob("*.safetensors")) / MIB
    return round(size + head, 1)


def checks(report: dict[str, Any]) -> dict[str, Any]:
    budget, weights, log = report["budget_mib"], report["weights_mib"], report["log"]
    last = log["last_utilisation"]
    peak = log["mlx_active_max_mib"]
    rss_peak = max(r["rss_peak_mib"] for r in report["waves"])
    growth = rss_peak - report["rss_before"]["VmRSS"]
    ratio = lambda v: round((v - weights) / budget, 3) if v is not None else None  # noqa: E731
    held = last.get("mlx_active_mib")
    return {"active_less_weights_over_budget_last": ratio(held),
            "active_less_weights_over_budget_peak": ratio(peak),
            # live arrays that are neither the weights nor the pool (the step's workspace)
            "active_beyond_weights_and_pool_mib": None if held is None else round(
                held - weights - (last.get("kv_pool_mib") or 0), 1),
            "rss_growth_mib": round(growth, 1),
            "rss_growth_over_budget": round(growth / budget, 3),
            # what RSS can grow by if MLX's buffer cache is all that holds more than the pool
            "budget_and_cache_mib": round(budget + (log["mlx_cache_max_mib"] or 0), 1),
            # the bound the runner documents: the pool's budget and its workspace
            "budget_and_workspace_mib": round(budget + (report["runner_ready"].get(
                "workspace_mib") or 0), 1),
            "served_all": all(r["ok"] == r["requests"] for r in report["waves"])}


def render(report: dict[str, Any]) -> str:
    r, c, log = report, report["checks"], report["log"]
    ready, last = r["runner_ready"], log["last_utilisation"]
    lines = [f"{r['model']}: memory.kv_tokens = {r['kv_tokens']} ({r['kv_bytes_per_token']} B a "
             f"token: budget {r['budget_mib']:.1f} MiB), weights {r['weights_mib']:.1f} MiB; "
             f"{r['clients']} clients a wave, {r['prompt_tokens']} tokens in (wave 2: "
             f"{r['shared_prefix']} shared), {r['output_tokens']} out",
             "runner.ready: " + ", ".join(f"{k} {ready.get(k)}" for k in READY_FIELDS),
             f"runner RSS after ready: {r['rss_before']['VmRSS']:.0f} MiB (VmHWM "
             f"{r['rss_before']['VmHWM']:.0f})", "",
             "| wave | ok | wall s | TTFT mean s | RSS peak MiB | RSS after MiB | VmHWM MiB | "
             "MLX active max MiB | pool pages max |", "|---|---|---|---|---|---|---|---|---|"]
    for w in r["waves"]:
        lines.append(f"| {w['wave']}{' (shared)' if w['shared_prefix'] else ''} | "
                     f"{w['ok']}/{w['requests']} | {w['wall_s']:.1f} | {w['ttft_mean_s']} | "
                     f"{w['rss_peak_mib']:.0f} | {w['rss_after_mib']:.0f} | {w['hwm_mib']:.0f} | "
                     f"{w['mlx_active_max_mib']} | {w['kv_pool_pages_max']} |")
    shared = [w for w in r["waves"] if w["shared_prefix"]]
    if shared:
        w = shared[0]
        lines += ["", f"shared-prefix wave: first request TTFT {w['first_ttft_s']} s; "
                  f"{w['hits']} hits, TTFT mean {w['hit_ttft_mean_s']} s; misses "
                  f"{w['miss_ttft_mean_s']} s; cached tokens mean {w['cached_tokens_mean']}"]
    def ok(v: float | None, limit: float = LIMIT) -> str:
        return "n/a" if v is None else ("ok" if v <= limit else "OVER")

    lines += ["", "last runner.utilisation: " + ", ".join(f"{k} {last.get(k)}"
                                                       for k in STATS_FIELDS)
              + f"; over the run: mlx_active max {log['mlx_active_max_mib']}, mlx_cache max "
              f"{log['mlx_cache_max_mib']}, kv_pool_pages max {log['kv_pool_pages_max']} "
              f"({log['utilisation_records']} records)",
              f"(MLX active - weights) / budget: last {c['active_less_weights_over_budget_last']}"
              f" ({ok(c['active_less_weights_over_budget_last'])}), peak "
              f"{c['active_less_weights_over_budget_peak']} "
              f"({ok(c['active_less_weights_over_budget_peak'])}); limit {LIMIT}; live arrays "
              f"beyond weights and pool (last): {c['active_beyond_weights_and_pool_mib']} MiB",
              f"RSS growth (peak - after ready): {c['rss_growth_mib']} MiB = "
              f"{c['rss_growth_over_budget']} x budget; budget + MLX cache max: "
              f"{c['budget_and_cache_mib']} MiB; budget + workspace bound (runner.ready "
              f"workspace_mib): {c['budget_and_workspace_mib']} MiB "
              f"({ok(c['rss_growth_mib'] / c['budget_and_workspace_mib'], 1.0)})",
              f"every request served: {c['served_all']}; warnings and errors logged: "
              f"{log['warnings'] or 'none'}"]
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.memory",
                                description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--kv-tokens", type=int, default=8192, help="memory.kv_tokens")
    p.add_argument("--clients", type=int, default=48, help="concurrent requests a wave")
    p.add_argument("--waves", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=900)
    p.add_argument("--shared-prefix", type=int, default=500,
                   help="tokens the second wave's prompts share (0: none)")
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--stats-interval", type=float, default=0.5, help="log.stats_interval_s")
    p.add_argument("--json", default="", help="write the results here")
    p.add_argument("--log", default="", help="keep the run's JSON log here (default: a "
                   "temporary file, removed at the end)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.command = sys.argv[1:] if argv is None else argv
    model_dir = resolve_model(args)
    with tempfile.TemporaryDirectory(prefix="mas-memory-") as tmp:
        report = measure(args, model_dir, Path(args.log or Path(tmp) / "log.jsonl"))
    print(render(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str) + "\n")
    return 0 if report["checks"]["served_all"] else 1


def measure(args: argparse.Namespace, model_dir: str, log_file: Path) -> dict[str, Any]:
    from models.info import read_model_info
    from models.tokenizer import load_tokenizer

    per_token = read_model_info(model_dir).kv_bytes_per_token
    waves = make_waves(PromptMaker(load_tokenizer(model_dir)), args)
    sets = [f"memory.kv_tokens={args.kv_tokens}", f"log.stats_interval_s={args.stats_interval}",
            f"log.file={log_file}", *args.set]
    report: dict[str, Any] = {
        "machine": machine(), "model": args.model_path or args.model,
        "when": time.strftime("%Y-%m-%d %H:%M"), "args": args.command,
        "kv_tokens": args.kv_tokens, "kv_bytes_per_token": per_token,
        "budget_mib": args.kv_tokens * per_token / MIB, "clients": args.clients,
        "prompt_tokens": args.prompt_tokens, "shared_prefix": args.shared_prefix,
        "output_tokens": args.output_tokens}
    with ours(model_dir, args.blas, sets) as target:
        ready = wait_for(log_file, "runner.ready")
        runner = actor_pids(target.pid).get("runner") or ready.get("pid")
        report["runner_ready"] = {k: ready.get(k) for k in READY_FIELDS}
        report["weights_mib"] = weights_mib(wait_for(log_file, "runner.weights"),
                                            wait_for(log_file, "runner.blas"), model_dir)
        report["rss_before"] = vm_mib(runner)
        report["waves"] = asyncio.run(drive(target, runner, waves, args))
    report["log"] = from_log(read_log(log_file), report["waves"])
    report["checks"] = checks(report)
    return report


if __name__ == "__main__":
    sys.exit(main())
