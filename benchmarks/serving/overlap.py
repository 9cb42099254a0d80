"""Runner idle fraction with overlap on vs off, under a steady concurrent load, side by side in
one run (a benchmark, not a test: the machine is shared and noisy, so compare the ratio).

    python -m benchmarks.serving.overlap [--model qwen3-small] [--concurrency 8] [--seconds 30]

Each mode starts the real graph, keeps `concurrency` ignore-EOS streams running for the given
time, and reads the runner's `runner.utilisation` log records (busy time over wall time per
interval); the first and last interval are dropped as warm-up and wind-down.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

from harness.graph import start_graph, stop_graph
from protocol.client import AsyncClient


async def load(address: str, concurrency: int, seconds: float, max_new: int) -> int:
    deadline = time.monotonic() + seconds
    done = 0

    async def worker(client: AsyncClient, k: int) -> None:
        nonlocal done
        while time.monotonic() < deadline:
            r = await client.generate(f"Request {k}-{done}: write about the sea.",
                                      max_new_tokens=max_new, ignore_eos=True)
            done += r.completion_tokens

    async with AsyncClient(address) as client:
        await asyncio.gather(*[worker(client, k) for k in range(concurrency)])
    return done


def utilisation_run(model: str, sets: list[str], concurrency: int, seconds: float,
                    max_new: int) -> tuple[int, list[dict]]:
    """A graph of the built-in `model` under `concurrency` closed-loop clients for `seconds`:
    the tokens generated and every runner.utilisation record its log holds (every 2 s)."""
    log_file = Path(tempfile.mkdtemp(prefix="mas-bench-")) / "log.jsonl"
    graph = start_graph(f"model.builtin={model}", f"log.file={log_file}",
                        "log.stats_interval_s=2", *sets)
    try:
        tokens = asyncio.run(load(graph.client, concurrency, seconds, max_new))
    finally:
        stop_graph(graph.proc)
    return tokens, [r for r in map(json.loads, log_file.read_text().splitlines())
                    if r.get("event") == "runner.utilisation"]


def measure(model: str, overlap: bool, args: argparse.Namespace) -> dict:
    tokens, stats = utilisation_run(model, [f"scheduler.overlap={str(overlap).lower()}",
                                            *args.set], args.concurrency, args.seconds,
                                    args.max_new_tokens)
    stats = stats[1:-1]  # the first and last intervals are partly idle
    busy = sum(r["busy_s"] for r in stats)
    wall = sum(r["wall_s"] for r in stats)
    steps = sum(r["steps"] for r in stats)
    return {"overlap": overlap, "idle_fraction": round(1 - busy / wall, 4) if wall else None,
            "steps_per_s": round(steps / wall, 2) if wall else None,
            "tokens_per_s": round(tokens / args.seconds, 2), "intervals": len(stats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.overlap",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-small")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seconds", type=float, default=30.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--set", action="append", default=[], help="extra launch --set overrides")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    rows = [measure(args.model, overlap, args) for overlap in (False, True)]
    print(f"model {args.model}, concurrency {args.concurrency}, {args.seconds:g} s per mode")
    print("| overlap | runner idle | steps/s | output tok/s |")
    print("|---|---|---|---|")
    for r in rows:
        print(f"| {'on' if r['overlap'] else 'off'} | {r['idle_fraction']:.2%} | "
              f"{r['steps_per_s']} | {r['tokens_per_s']} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
