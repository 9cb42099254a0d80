"""Prefill speed of a hybrid (Qwen3.5) model: one prompt at a time, time to its first token,
ours with the gated-delta kernel (or its blocks) and the convolution kernel (or shifted sums)
against ours with mlx-lm's per-token loop and MLX's convolution (`runtime.linear_prefill =
false`; the SiLU and softmax kernels stay on) and against mlx_lm.server, on the same model
and BLAS.

    python -m benchmarks.serving.hybrid [--model qwen3_5-small] [--tokens 512 2000] [--repeats 2]

Every request is a fresh prompt (no prefix cache hit) of exactly that many tokens asking for
one output token; prefill tokens/s = prompt tokens / TTFT (the request sent to its stream's
end), the best of the repeats. Then ten short prompts, each sent twice: how many second sends
hit the prefix cache, and their TTFT over the first's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from benchmarks.serving.load import PromptMaker, Sample, Target, closed_loop
from benchmarks.serving.servers import mlx_lm_server, ours


def ttfts(target: Target, prompts: list[str]) -> list[tuple[float, Sample]]:
    """The prompts one after another, each a request for one token timed to its stream's end
    (the first token of a random model is often a piece of a UTF-8 character, which streams
    no text of its own): load.closed_loop with one client."""
    samples, _ = asyncio.run(closed_loop(target, prompts, 1, 1))
    for s in samples:
        if s.error:
            raise RuntimeError(f"{target.name}: {s.error}")
    return [(s.ended - s.sent, s) for s in samples]


TARGET = 0.2  # the issue's bound on a second send's TTFT over the first's

SHORT = ["Hi!", "What is rain?", "Name a color.", "Count to three.", "Tell me a joke.",
         "2 + 2 =", "Why is the sky blue?", "Say hello in French.", "List two fruits.",
         "Good morning, how are you today?"]


def repeats(target: Target, prompts: list[str]) -> dict:
    """Each prompt sent twice in a row: did the second hit, and its TTFT over the first's."""
    # One pair first, outside the table: a process's first hit runs its code paths (client
    # and server) for the first time, ~3 ms more than any hit after it.
    ttfts(target, ["Warm up.", "Warm up."])
    rows = []
    for p in prompts:
        (first, _), (second, got) = ttfts(target, [p, p])
        rows.append({"prompt_tokens": got.prompt_tokens, "ttft_first": first,
                     "ttft_second": second, "cached_second": got.cached_tokens})
    hits = sum(r["cached_second"] >= r["prompt_tokens"] - 1 for r in rows)
    ratios = sorted(r["ttft_second"] / r["ttft_first"] for r in rows)
    return {"hits": hits, "of": len(rows), "ttft_ratio_median": ratios[len(ratios) // 2],
            "ttft_ratio_max": ratios[-1], "within_target": sum(x <= TARGET for x in ratios),
            "rows": rows}


def measure(target: Target, warm: str, prompts: dict[int, list[str]]) -> dict[int, float]:
    ttfts(target, [warm])
    return {n: max(n / t for t, _ in ttfts(target, ps)) for n, ps in prompts.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.hybrid",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3_5-small")
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2000])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--blas", default="auto")
    p.add_argument("--no-mlx-lm", action="store_true")
    p.add_argument("--set", action="append", default=[], help="extra launch --set overrides "
                   "(both of our configurations)")
    p.add_argument("--json", help="write the results here too")
    args = p.parse_args(argv)
    from models.builtin import ensure_builtin
    from models.info import read_model_info
    from models.tokenizer import load_tokenizer

    model_dir = str(ensure_builtin(args.model))
    maker = PromptMaker(load_tokenizer(model_dir))
    warm, prompts = maker.make(64, seed=7), {}
    for k, n in enumerate(args.tokens):
        prompts[n] = [maker.make(n, seed=100 * k + r) for r in range(args.repeats)]
    eos = read_model_info(model_dir).eos_ids
    results = {}
    # Short: below cache.snapshot_interval (128), where hybrid prompts used to miss.
    short = {"3-10 tokens": SHORT,
             "100 tokens": [maker.make(100, seed=1000 + r) for r in range(len(SHORT))]}
    with ours(model_dir, args.blas, args.set) as target:
        results["ours"] = measure(target, warm, prompts)
        repeat = {name: repeats(target, ps) for name, ps in short.items()}
    with ours(model_dir, args.blas, ["runtime.linear_prefill=false", *args.set]) as target:
        results["ours, mlx-lm's loop"] = measure(target, warm, prompts)
    if not args.no_mlx_lm:
        with mlx_lm_server(model_dir, args.blas, eos) as target:
            results["mlx_lm.server"] = measure(target, warm, prompts)
    print(f"model {args.model}: prefill tokens/s (prompt tokens / TTFT, best of "
          f"{args.repeats})")
    print("| server | " + " | ".join(f"{n} tokens" for n in args.tokens) + " |")
    print("|---|" + "---|" * len(args.tokens))
    for name, row in results.items():
        print(f"| {name} | " + " | ".join(f"{row[n]:.0f}" for n in args.tokens) + " |")
    base = results["ours"]
    for name, row in results.items():
        if name != "ours":
            print(f"ours / {name}: " + ", ".join(f"{base[n] / row[n]:.2f}x at {n}"
                                                 for n in args.tokens))
    print("\nten short prompts sent twice (TTFT: a one-token request, sent to its end)")
    print("| prompts | second sends cached >= prompt - 1 | TTFT second / first, median | max | "
          f"second sends <= {TARGET}x |")
    print("|---|---|---|---|---|")
    for name, r in repeat.items():
        print(f"| {name} | {r['hits']} of {r['of']} | {r['ttft_ratio_median']:.2f} | "
              f"{r['ttft_ratio_max']:.2f} | {r['within_target']} of {r['of']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({**results, "repeats": repeat}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
