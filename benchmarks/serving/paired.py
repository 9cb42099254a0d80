"""Stored formats at one request, paired: every format's graph is up at once and the requests
take turns (f32, 4bit, f32, 4bit, ...), one at a time, so a machine whose speed drifts over
seconds and minutes (shared cores) slows every format alike. formats.py serves the formats in
blocks of minutes, one after the other; on the 2-core VM one such round's c = 1 ratio ranged
1.9-2.5x within half an hour. Here each pair of adjacent requests gives one ratio.

    python -m benchmarks.serving.paired [--formats f32 4bit] [--pairs 24] [--json PATH]

Output tok/s per format is its tokens over its requests' wall time (send to the stream's end,
as formats.py's c = 1 level); the ratio is each format's against the first, with the median
and quartiles of the per-pair ratios. The idle graphs wait on their sockets meanwhile.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.serving.formats import F32, checkpoints
from benchmarks.serving.load import PromptMaker, one_lean
from benchmarks.serving.report import machine_text
from benchmarks.serving.run import machine
from benchmarks.serving.servers import ours

ROOT = Path(__file__).resolve().parents[2]


def quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else values * 3
    return q[0], statistics.median(values), q[-1]


def summarize(names: list[str], runs: dict[str, list[Any]]) -> dict[str, Any]:
    """Per format: requests, tokens, wall, output tok/s; per later format: the ratio of totals
    and the per-pair ratios' quartiles against the first."""
    out: dict[str, Any] = {"formats": {}, "ratios": {}}
    for name in names:
        samples = runs[name]
        tokens, wall = sum(s.tokens for s in samples), sum(s.ended - s.sent for s in samples)
        out["formats"][name] = {"requests": len(samples), "tokens": tokens, "wall_s": wall,
                                "output_tok_s": tokens / wall if wall else 0.0,
                                "errors": sum(bool(s.error) for s in samples)}
    base = names[0]
    for name in names[1:]:
        per_pair = [(s.tokens / (s.ended - s.sent)) / (b.tokens / (b.ended - b.sent))
                    for s, b in zip(runs[name], runs[base])]
        lo, mid, hi = quartiles(per_pair)
        out["ratios"][name] = {
            "of_totals": out["formats"][name]["output_tok_s"] / out["formats"][base]["output_tok_s"],
            "pair_median": mid, "pair_q1": lo, "pair_q3": hi, "pairs": per_pair}
    return out


async def take_turns(targets: dict[str, Any], prompts: list[str], output_tokens: int,
                     warmup: int) -> dict[str, list[Any]]:
    runs: dict[str, list[Any]] = {name: [] for name in targets}
    for name, target in targets.items():
        for _ in range(warmup):
            await one_lean(target, prompts[0], 8)
    for k, prompt in enumerate(prompts):
        # Which format goes first alternates, so neither always follows the other.
        order = list(targets) if k % 2 == 0 else list(reversed(targets))
        for name in order:
            sample = await one_lean(targets[name], prompt, output_tokens)
            if sample.error:
                raise RuntimeError(f"{name}: {sample.error}")
            runs[name].append(sample)
    return runs


def markdown(result: dict[str, Any]) -> str:
    names = list(result["formats"])
    where = f" on {machine_text(result['machine'])}" if result.get("machine") else ""
    lines = [f"Measured by `{result['command']}`{where}: {result['pairs']} pairs "
             f"of requests ({result['prompt_tokens']}-token prompts, exactly "
             f"{result['output_tokens']} output tokens, greedy, the lean client), the "
             "formats' graphs up at once and taking turns.", "",
             "| format | requests | output tok/s | vs " + names[0] + " (totals) "
             "| per-pair ratio: median (q1-q3) |", "|---|---|---|---|---|"]
    for name in names:
        f = result["formats"][name]
        r = result["ratios"].get(name)
        ratio = "1.00" if r is None else f"{r['of_totals']:.2f}"
        pairs = "" if r is None else (f"{r['pair_median']:.2f} ({r['pair_q1']:.2f}-"
                                      f"{r['pair_q3']:.2f})")
        lines.append(f"| {name} | {f['requests']} | {f['output_tok_s']:.1f} | {ratio} | {pairs} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.paired",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-small", help="built-in model whose variants run")
    p.add_argument("--formats", nargs="+", default=[F32, "4bit"],
                   help="variants of --model; ratios are against the first")
    p.add_argument("--pairs", type=int, default=24, help="requests per format")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--warmup", type=int, default=2, help="short requests per format first")
    p.add_argument("--blas", default="auto", help="runtime.blas of every graph")
    p.add_argument("--set", action="append", default=[], help="launch --set for every graph")
    p.add_argument("--json", default="", help="write the result here too")
    args = p.parse_args(argv)
    if len(args.formats) < 2:
        p.error("--formats takes at least two formats to compare")
    if args.pairs < 1:
        p.error(f"--pairs must be at least 1, got {args.pairs}")
    args.model_path = []  # checkpoints(): the built-in's variants
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from models.tokenizer import load_tokenizer

    found = checkpoints(args)
    maker = PromptMaker(load_tokenizer(found[0][1]))
    prompts = [maker.make(args.prompt_tokens, seed=5000 + k) for k in range(args.pairs)]
    with contextlib.ExitStack() as stack:
        targets = {fmt: stack.enter_context(ours(path, args.blas, args.set))
                   for fmt, (_, path) in zip(args.formats, found)}
        runs = asyncio.run(take_turns(targets, prompts, args.output_tokens, args.warmup))
    result = {"command": "python -m benchmarks.serving.paired "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "model": args.model,
              "pairs": args.pairs, "prompt_tokens": args.prompt_tokens,
              "output_tokens": args.output_tokens, **summarize(args.formats, runs)}
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
