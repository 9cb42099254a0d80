"""Sampled requests under load: output tokens/s and ITL at one concurrency with the sampling
settings clients send (a temperature, top_p, top_k, min_p), against greedy, on one server in
one run; optionally mlx_lm.server on the same checkpoint, settings and BLAS.

    python -m benchmarks.serving.sampling [--model qwen3-small-4bit | --model-path DIR]
        [--concurrency 16] [--rounds 2] [--mlx-lm] [--json F]

Every request streams exactly --tokens tokens (ignore_eos; mlx_lm.server: a logit bias on
EOS). Rounds cycle through the settings on the same server; each setting's figure is the
median over rounds. Greedy rows take the greedy head where it is installed (no logits); drawn
rows need the full logits, then the filters and the draw (sampling.py).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.serving.load import PromptMaker, Target, closed_loop, summarize
from benchmarks.serving.run import add_model_args, resolve_model
from benchmarks.serving.servers import mlx_lm_server, ours

SETTINGS: dict[str, dict[str, Any]] = {
    "greedy": {"temperature": 0.0},
    "temperature 0.7": {"temperature": 0.7},
    "temperature 0.7, top_p 0.9": {"temperature": 0.7, "top_p": 0.9},
    "temperature 0.7, top_k 50": {"temperature": 0.7, "top_k": 50},
    "temperature 1.0, min_p 0.05": {"temperature": 1.0, "min_p": 0.05},
}


def sweep(target: Target, prompts: list[str], args: argparse.Namespace,
          settings: dict[str, dict[str, Any]]) -> dict[str, dict[str, list[float]]]:
    """Per setting, per round: output tok/s, ITL p50 (ms) and failed requests (a server that
    drops connections is counted, not stopped for)."""
    out = {name: {"tok_s": [], "itl_p50_ms": [], "errors": []} for name in settings}
    asyncio.run(closed_loop(target, prompts[:1], 1, 8))  # warm-up
    for _ in range(args.rounds):
        for name, body in settings.items():
            t = dataclasses.replace(target, extra={**target.extra, **body})
            samples, wall = asyncio.run(closed_loop(t, prompts, args.concurrency, args.tokens))
            row = summarize(samples, wall, args.concurrency)
            out[name]["tok_s"].append(row["output_tok_s"])
            out[name]["itl_p50_ms"].append(1000 * row["itl_p50_s"])
            out[name]["errors"].append(row["errors"])
            print(f"{target.name} {name}: {row['output_tok_s']:.0f} tok/s, errors "
                  f"{row['errors']} {row['first_error']}", file=sys.stderr)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.sampling",
                                description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.set_defaults(model="qwen3-small-4bit")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--tokens", type=int, default=128, help="output tokens per request")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--mlx-lm", action="store_true", help="mlx_lm.server too (same settings)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    from models.info import read_model_info
    from models.tokenizer import load_tokenizer

    model_dir = resolve_model(args)
    maker = PromptMaker(load_tokenizer(model_dir))
    prompts = [maker.make(args.prompt_tokens, seed=k) for k in range(args.concurrency)]
    results = {}
    with ours(model_dir, args.blas, args.set) as target:
        results[target.name] = sweep(target, prompts, args, SETTINGS)
    if args.mlx_lm:  # its top_k / min_p body fields are mlx_lm.server's own names too
        eos = read_model_info(model_dir).eos_ids
        with mlx_lm_server(model_dir, args.blas, eos) as target:
            results[target.name] = sweep(target, prompts, args, SETTINGS)
    print(f"{Path(model_dir).name}, c={args.concurrency}, {args.concurrency} requests x "
          f"{args.prompt_tokens} + {args.tokens} tokens, median of {args.rounds} rounds")
    print("| server | settings | output tok/s | / greedy | ITL p50 | errors |")
    print("|---|---|---|---|---|---|")
    for server, rows in results.items():
        greedy = statistics.median(rows["greedy"]["tok_s"])
        for name, row in rows.items():
            rate = statistics.median(row["tok_s"])
            print(f"| {server} | {name} | {rate:.1f} | {rate / greedy:.2f} | "
                  f"{statistics.median(row['itl_p50_ms']):.1f} ms | {sum(row['errors'])} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": model_dir, "args": vars(args),
                                               "results": results}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
