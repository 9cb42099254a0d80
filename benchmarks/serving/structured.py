"""Structured output under load: output tokens/s at concurrency 16 with half of the requests
constrained by a JSON schema, against all of them unconstrained, on one server in one run;
and what the grammar costs per token (the masks on the host, their application in MLX).

    python -m benchmarks.serving.structured [--model qwen3-small] [--rounds 3] [--json F]

Every request streams exactly --tokens tokens (ignore_eos; the schema asks for a list longer
than that, so a constrained request is masked at every token). Rounds alternate the two mixes
on the same server; the ratio is the median over rounds of mixed / unconstrained tok/s.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from benchmarks.serving.load import PromptMaker, Target, closed_loop, pct
from benchmarks.serving.servers import ours

TARGET = 0.85  # the bound on mixed / unconstrained throughput
SCHEMA = {"type": "object", "properties": {"values": {
    "type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999},
    "minItems": 200}}, "required": ["values"], "additionalProperties": False}


def run_mix(plain: Target, held: Target, prompts: list[str], concurrency: int,
            tokens: int, constrained: bool) -> float:
    """Output tok/s of `prompts` through `concurrency` workers; with `constrained`, every
    other worker's requests carry the schema."""
    pick = (lambda w: held if w % 2 else plain) if constrained else None
    samples, wall = asyncio.run(closed_loop(plain, prompts, concurrency, tokens,
                                            worker_target=pick))
    if failed := next((s.error for s in samples if s.error), None):
        raise RuntimeError(failed)
    return sum(s.tokens for s in samples) / wall


def mask_costs(model_dir: str, vocab: int, eos: int, rows: int = 8) -> dict:
    """Per token, on this host: llguidance's next-token mask for one row (the schema above,
    walked by random logits through its own masks), and applying [rows, vocab] masks to
    float32 logits in MLX."""
    import mlx.core as mx

    from actors.constraints import compile_constraint
    from actors.model_runner.grammar import apply_masks, grammars_for

    grammars = grammars_for(model_dir, vocab, eos)
    matcher = grammars.matcher(compile_constraint("json_schema", json.dumps(SCHEMA)))
    rng = np.random.default_rng(0)
    times = []
    for _ in range(200):
        start = time.perf_counter()
        bits = grammars.masks([matcher])
        times.append(time.perf_counter() - start)
        logits = mx.array(rng.normal(size=(1, vocab)).astype(np.float32))
        matcher.consume_token(int(mx.argmax(apply_masks(logits, bits), axis=-1).item()))
    batch = np.repeat(bits, rows, axis=0)
    logits = mx.array(rng.normal(size=(rows, vocab)).astype(np.float32))
    mx.eval(apply_masks(logits, batch))
    applied = []
    for _ in range(50):
        start = time.perf_counter()
        mx.eval(apply_masks(logits, batch))
        applied.append(time.perf_counter() - start)
    return {"mask_us_p50": pct(times, 50) * 1e6, "mask_us_p99": pct(times, 99) * 1e6,
            "apply_rows": rows, "apply_us_p50": pct(applied, 50) * 1e6}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.structured",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-small")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=32, help="per round and mix")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--blas", default="auto")
    p.add_argument("--set", action="append", default=[], help="extra launch --set overrides")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    from models.builtin import ensure_builtin
    from models.info import read_model_info
    from models.tokenizer import load_tokenizer

    model_dir = str(ensure_builtin(args.model))
    info = read_model_info(model_dir)
    maker = PromptMaker(load_tokenizer(model_dir))
    prompts = [maker.make(32, seed=r) for r in range(args.requests)]
    fmt = {"type": "json_schema", "json_schema": {"name": "values", "schema": SCHEMA}}
    rates: dict[str, list[float]] = {"unconstrained": [], "half constrained": []}
    with ours(model_dir, args.blas, args.set) as plain:
        held = dataclasses.replace(plain, extra={**plain.extra, "response_format": fmt})
        run_mix(plain, held, prompts[:args.concurrency], args.concurrency, 8, True)  # warm
        for _ in range(args.rounds):
            for name in rates:
                rates[name].append(run_mix(plain, held, prompts, args.concurrency,
                                           args.tokens, name != "unconstrained"))
    ratios = [b / a for a, b in zip(rates["unconstrained"], rates["half constrained"])]
    costs = mask_costs(model_dir, info.vocab_size, info.eos_ids[0])
    print(f"model {args.model}, c={args.concurrency}, {args.requests} requests x "
          f"{args.tokens} tokens per mix, {args.rounds} rounds (output tok/s)")
    print("| mix | " + " | ".join(f"round {k + 1}" for k in range(args.rounds)) + " | median |")
    print("|---|" + "---|" * (args.rounds + 1))
    for name, row in rates.items():
        print(f"| {name} | " + " | ".join(f"{r:.1f}" for r in row) +
              f" | {statistics.median(row):.1f} |")
    print(f"half constrained / unconstrained: median {statistics.median(ratios):.2f}x "
          f"(rounds {', '.join(f'{r:.2f}' for r in ratios)}; target >= {TARGET}x)")
    print(f"grammar mask per row and token: p50 {costs['mask_us_p50']:.0f} us, p99 "
          f"{costs['mask_us_p99']:.0f} us; applying {costs['apply_rows']} rows' masks: "
          f"{costs['apply_us_p50']:.0f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"rates": rates, "ratios": ratios,
                                               "mask": costs, "model": args.model}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
