"""Scale-out on one machine: tensor parallel (runner.tp = 2) and data parallel (scheduler.dp =
2) against one runner, side by side in one run, and the cost of one all-reduce over the ring.

    python -m benchmarks.serving.scale [--model qwen3-small] [--concurrency 1 16] [--seconds 20]

On a 2-core machine neither layout is faster: both split the same two cores. What this
measures is the overhead per step that matters on real multi-machine setups: each layout keeps
`c` ignore-EOS streams running and reads the runner's `runner.utilisation` records (busy time
and steps per interval; the first and last interval are dropped). The all-reduce part starts
two ranks of an mlx.distributed ring over loopback and times `all_sum` of the [rows, hidden]
float32 activations a sharded layer sums (two per layer and step), which gives the model of
TP = 2 across two machines printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from actors.model_runner.tensor_parallel import ring_hostfile
from benchmarks.serving.overlap import utilisation_run
from protocol.transport import parse_name

LAYOUTS = {"tp1": [], "tp2": ["runner.tp=2"], "dp2": ["scheduler.dp=2"]}


def measure(model: str, layout: str, concurrency: int, args: argparse.Namespace) -> dict:
    tokens, records = utilisation_run(model, [*LAYOUTS[layout], *args.set], concurrency,
                                      args.seconds, args.max_new_tokens)
    # Rank 0 of each replica: "runner" and "runner.1" (the other ranks run the same steps).
    runners = sorted({r["actor"] for r in records if parse_name(r["actor"])[2] == 0})
    per_runner = []
    for name in runners:
        stats = [r for r in records if r["actor"] == name][1:-1]
        busy, steps = sum(r["busy_s"] for r in stats), sum(r["steps"] for r in stats)
        per_runner.append({"runner": name, "step_ms": round(1000 * busy / steps, 2)
                           if steps else None, "steps": steps})
    steps = [r["step_ms"] for r in per_runner if r["step_ms"]]
    return {"layout": layout, "concurrency": concurrency,
            "tokens_per_s": round(tokens / args.seconds, 2),
            "step_ms": round(sum(steps) / len(steps), 2) if steps else None,
            "runners": per_runner}


def collective(hidden: int, rows: list[int], repeats: int = 300) -> dict[int, float]:
    """ms per all_sum of [rows, hidden] float32 between two ranks over loopback."""
    from protocol.transport import free_ports

    ports = free_ports("127.0.0.1", 2)
    hostfile = ring_hostfile([f"127.0.0.1:{p}" for p in ports])
    out = Path(tempfile.mkdtemp(prefix="mas-ring-")) / "rank0.json"
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks.serving.scale", "--rank-child",
                               str(hidden), ",".join(map(str, rows)), str(repeats), str(out)],
                              env={**os.environ, "MLX_RANK": str(k),
                                   "MLX_HOSTFILE": str(hostfile)})
             for k in range(2)]
    for p in procs:
        p.wait(300)
    os.unlink(hostfile)
    return {int(k): v for k, v in json.loads(out.read_text()).items()}


def _rank_child(hidden: int, rows: str, repeats: int, out: str) -> None:
    from actors.model_runner.cpu import blas

    blas.load("auto")
    import mlx.core as mx

    group = mx.distributed.init(strict=True, backend="ring")
    got = {}
    for n in map(int, rows.split(",")):
        x = mx.ones((n, hidden))
        for _ in range(20):
            mx.eval(mx.distributed.all_sum(x, group=group))
        start = time.perf_counter()
        for _ in range(repeats):
            mx.eval(mx.distributed.all_sum(x, group=group))
        got[n] = 1000 * (time.perf_counter() - start) / repeats
    if group.rank() == 0:
        Path(out).write_text(json.dumps(got))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--rank-child"]:
        _rank_child(int(argv[1]), argv[2], int(argv[3]), argv[4])
        return 0
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.scale",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-small")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--set", action="append", default=[], help="extra launch --set overrides")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    from models.builtin import ensure_builtin

    config = json.loads((ensure_builtin(args.model) / "config.json").read_text())
    hidden, layers = config["hidden_size"], config["num_hidden_layers"]
    rows = [measure(args.model, layout, c, args) for c in args.concurrency for layout in LAYOUTS]
    ring = collective(hidden, args.concurrency)
    print(f"model {args.model} ({layers} layers, hidden {hidden}), {args.seconds:g} s per "
          f"layout and concurrency, {os.cpu_count()} cores")
    print("| layout | c | output tok/s | ms per step (rank 0 / replica) | vs tp1 |")
    print("|---|---|---|---|---|")
    base = {r["concurrency"]: r for r in rows if r["layout"] == "tp1"}
    for r in rows:
        b = base[r["concurrency"]]
        extra = (f"{r['step_ms'] - b['step_ms']:+.2f} ms" if r["step_ms"] and b["step_ms"]
                 else "n/a")
        print(f"| {r['layout']} | {r['concurrency']} | {r['tokens_per_s']} | {r['step_ms']} | "
              f"{extra} |")
    print("\n| rows | bytes per all_sum | ms per all_sum (loopback) | per step (2 per layer) |")
    print("|---|---|---|---|")
    for n, ms in sorted(ring.items()):
        print(f"| {n} | {n * hidden * 4} | {ms:.3f} | {2 * layers * ms:.2f} ms |")
    if args.json:
        Path(args.json).write_text(json.dumps({"layouts": rows, "all_sum_ms": ring,
                                               "hidden": hidden, "layers": layers}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
