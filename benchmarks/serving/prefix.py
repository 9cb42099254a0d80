"""Time to first token for a prompt whose long prefix is cached vs cold, on a dense and a
hybrid built-in model (a benchmark, not a test: compare the ratio, measured in one run).

    python -m benchmarks.serving.prefix [--models qwen3-small qwen3_5-tiny] [--prefix-tokens 2000]

For each model: start the real graph (prefix cache on), then for several distinct prefixes send
prefix + question A (cold: nothing cached) and prefix + question B (the prefix is cached), and
time the first streamed token at the client.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from harness.graph import start_graph, stop_graph
from protocol.client import Client


def ttft(client: Client, ids: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    first = None
    for piece in client.generate(ids, max_new_tokens=4, ignore_eos=True, stream=True):
        if first is None:
            first = time.perf_counter() - t0
        final = piece
    return first, final.cached_tokens


def measure(model: str, prefix_tokens: int, rounds: int, extra: list[str]) -> dict:
    graph = start_graph(f"model.builtin={model}", *extra)
    cold, hit, cached = [], [], []
    try:
        with Client(graph.client, timeout=600) as client:
            ttft(client, [100 + i for i in range(64)])  # warm up
            for r in range(rounds):
                # Distinct prefixes (token ids from the ordinary vocabulary), never seen before.
                prefix = [1000 + (r * 7919 + i * 31) % 50000 for i in range(prefix_tokens)]
                t, _ = ttft(client, prefix + [11, 12, 13, 14, 15, 16, 17, 18])
                cold.append(t)
                t, c = ttft(client, prefix + [21, 22, 23, 24, 25, 26, 27, 28])
                hit.append(t)
                cached.append(c)
    finally:
        stop_graph(graph.proc)
    c, h = statistics.median(cold), statistics.median(hit)
    return {"model": model, "prefix_tokens": prefix_tokens, "cold_ttft_s": round(c, 4),
            "hit_ttft_s": round(h, 4), "ratio": round(h / c, 4),
            "cached_tokens": int(statistics.median(cached)), "rounds": rounds}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.prefix",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["qwen3-small", "qwen3_5-tiny"])
    p.add_argument("--prefix-tokens", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--set", action="append", default=[], help="extra launch --set overrides")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    rows = [measure(model, args.prefix_tokens, args.rounds, args.set) for model in args.models]
    print("| model | prefix tokens | cached tokens | cold TTFT | hit TTFT | hit / cold |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['prefix_tokens']} | {r['cached_tokens']} | "
              f"{r['cold_ttft_s'] * 1000:.0f} ms | {r['hit_ttft_s'] * 1000:.0f} ms | "
              f"{r['ratio']:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
