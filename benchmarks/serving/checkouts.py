"""This checkout against another checkout of the same repository (a git worktree of main, say),
paired: both graphs are up at once and the requests take turns, so a machine whose speed drifts
over seconds and minutes (shared cores) slows both alike. paired.py does the same for stored
formats; this shows a change is no slower than the code it changes.

    python -m benchmarks.serving.checkouts --other PATH [--model qwen3-small] [--pairs 12]
        [--concurrency 1 16] [--prompt-tokens 128] [--output-tokens 64]
        [--prefix-tokens 1500] [--json PATH]

A is the other checkout, B this one, and every ratio is B/A: above 1 for tok/s, below 1 for
TTFT, means this checkout is faster. Each graph is its own checkout's launcher and
configs/qwen.toml (run from that checkout's root, so it imports that code) under this venv's
Python, on the same model directory, default config otherwise (prefix cache on). Which side
goes first alternates from one pair to the next, so neither always follows the other.
- c = 1: `pairs` pairs of single streamed requests; a side's output tok/s is its tokens over
  its requests' wall time (send to the stream's end), and each pair gives one ratio.
- c > 1: `waves` pairs of waves of c concurrent requests (closed_loop, one side, then the
  other); a wave's output tok/s is its tokens over its wall time.
- prefix hit: for `prefixes` distinct long prefixes, never sent before, each side sends
  prefix + one question (cold) then prefix + another (the prefix cached); TTFT at the client.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

from benchmarks.serving.load import PromptMaker, Sample, Target, closed_loop, one_lean
from benchmarks.serving.paired import quartiles
from benchmarks.serving.report import machine_text
from benchmarks.serving.run import machine
from harness.graph import ROOT, start_graph, stop_graph

A, B = "other", "this"
PREFIX_OUTPUT_TOKENS = 4  # the prefix pass times the first token only


@contextlib.contextmanager
def served(root: Path, model_dir: str, blas: str, overrides: list[str]) -> Iterator[Target]:
    """The graph of the checkout at `root`, on `model_dir`."""
    graph = start_graph(f"model.path={model_dir}", f"runtime.blas={blas}", *overrides,
                        root=root)
    try:
        yield Target(str(root), graph.http + "/v1", graph.model, {"ignore_eos": True},
                     graph.proc.pid)
    finally:
        stop_graph(graph.proc)


def checkout(root: Path) -> dict[str, Any]:
    """Where a checkout stands: its branch, HEAD, and how many files differ from HEAD."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True,
                              check=True).stdout.strip()

    return {"root": str(root), "branch": git("rev-parse", "--abbrev-ref", "HEAD"),
            "head": git("rev-parse", "--short", "HEAD"),
            "dirty_files": len(git("status", "--porcelain").splitlines())}


def turns(k: int) -> tuple[str, str]:
    return (A, B) if k % 2 == 0 else (B, A)


def spread(ratios: list[float]) -> dict[str, Any]:
    q1, median, q3 = quartiles(ratios)
    return {"median": median, "q1": q1, "q3": q3, "each": ratios}


def checked(side: str, sample: Sample) -> Sample:
    if sample.error:
        raise RuntimeError(f"{side}: {sample.error}")
    return sample


def tok_s(samples: list[Sample]) -> float:
    return sum(s.tokens for s in samples) / sum(s.ended - s.sent for s in samples)


async def warm(target: Target, prompts: dict[str, Any], output_tokens: int) -> None:
    """Short requests first, one wave of each level and one long prompt: the first of each
    shape costs more (allocation), and neither side should pay it in a measured pair."""
    checked(target.name, await one_lean(target, prompts["short"], 8))
    for c, wave in prompts["waves"].items():
        samples, _ = await closed_loop(target, wave, c, 8, client_kind="lean")
        for sample in samples:
            checked(target.name, sample)
    checked(target.name, await one_lean(target, prompts["long"], PREFIX_OUTPUT_TOKENS))


async def single(targets: dict[str, Target], prompts: list[str],
                 output_tokens: int) -> dict[str, Any]:
    runs: dict[str, list[Sample]] = {A: [], B: []}
    for k, prompt in enumerate(prompts):
        for side in turns(k):
            runs[side].append(checked(side, await one_lean(targets[side], prompt,
                                                           output_tokens)))
    return {"concurrency": 1, "pairs": len(prompts), A: tok_s(runs[A]), B: tok_s(runs[B]),
            "ratio": spread([tok_s([b]) / tok_s([a]) for a, b in zip(runs[A], runs[B])])}


async def waves(targets: dict[str, Target], prompts: list[list[str]], concurrency: int,
                output_tokens: int) -> dict[str, Any]:
    tokens = {A: 0, B: 0}
    walls: dict[str, list[float]] = {A: [], B: []}
    rates: dict[str, list[float]] = {A: [], B: []}
    for k, wave in enumerate(prompts):
        for side in turns(k):
            samples, wall = await closed_loop(targets[side], wave, concurrency, output_tokens,
                                              client_kind="lean")
            done = sum(checked(side, s).tokens for s in samples)
            tokens[side] += done
            walls[side].append(wall)
            rates[side].append(done / wall)
    return {"concurrency": concurrency, "pairs": len(prompts),
            **{side: tokens[side] / sum(walls[side]) for side in (A, B)},
            "per_wave": rates, "ratio": spread([b / a for a, b in zip(rates[A], rates[B])])}


async def prefix_hits(targets: dict[str, Target],
                      rounds: list[tuple[str, str, str]]) -> dict[str, Any]:
    seen: dict[str, dict[str, list[float]]] = {side: {"cold": [], "hit": [], "cached": []}
                                               for side in (A, B)}
    for k, (prefix, first, second) in enumerate(rounds):
        for side in turns(k):
            cold = checked(side, await one_lean(targets[side], prefix + first,
                                                PREFIX_OUTPUT_TOKENS))
            hit = checked(side, await one_lean(targets[side], prefix + second,
                                               PREFIX_OUTPUT_TOKENS))
            seen[side]["cold"].append(cold.ttft)
            seen[side]["hit"].append(hit.ttft)
            seen[side]["cached"].append(hit.cached_tokens)
    out: dict[str, Any] = {"prefixes": len(rounds)}
    for side in (A, B):
        out[side] = {"cold_ttft_s": statistics.median(seen[side]["cold"]),
                     "hit_ttft_s": statistics.median(seen[side]["hit"]),
                     "cached_tokens": statistics.median(seen[side]["cached"]), **seen[side]}
    for kind in ("cold", "hit"):
        out[f"{kind}_ratio"] = spread([b / a for a, b in zip(seen[A][kind], seen[B][kind])])
    return out


async def measure(targets: dict[str, Target], prompts: dict[str, Any],
                  args: argparse.Namespace) -> dict[str, Any]:
    for k in range(2):
        for side in turns(k):
            await warm(targets[side], prompts["warmup"], args.output_tokens)
    levels = []
    for c in args.concurrency:
        if c == 1:
            levels.append(await single(targets, prompts["single"], args.output_tokens))
        else:
            levels.append(await waves(targets, prompts["waves"][c], c, args.output_tokens))
    return {"levels": levels, "prefix": await prefix_hits(targets, prompts["prefix"])}


def plan(maker: PromptMaker, args: argparse.Namespace) -> dict[str, Any]:
    """Every prompt of the run, each distinct from the others (no prefix hit but the meant
    ones); both sides get the same ones."""
    p = args.prompt_tokens
    levels = [c for c in args.concurrency if c > 1]
    return {
        "warmup": {"short": maker.make(p, seed=40_000),
                   "waves": {c: [maker.make(p, seed=41_000 + c * 100 + i) for i in range(c)]
                             for c in levels},
                   "long": maker.make(args.prefix_tokens, seed=42_000)},
        "single": [maker.make(p, seed=10_000 + k) for k in range(args.pairs)],
        "waves": {c: [[maker.make(p, seed=20_000 + c * 1000 + w * c + i) for i in range(c)]
                      for w in range(args.waves)] for c in levels},
        "prefix": [(maker.make(args.prefix_tokens, seed=30_000 + r),
                    maker.make(32, seed=31_000 + 2 * r), maker.make(32, seed=31_001 + 2 * r))
                   for r in range(args.prefixes)],
    }


def markdown(result: dict[str, Any]) -> str:
    def side(c: dict[str, Any]) -> str:
        dirty = f"{c['dirty_files']} files changed" if c["dirty_files"] else "clean"
        return f"`{c['root']}` ({c['branch']} {c['head']}, {dirty})"

    def ratio(r: dict[str, Any]) -> str:
        return f"{r['median']:.3f} ({r['q1']:.3f}-{r['q3']:.3f})"

    co, pre = result["checkouts"], result["prefix"]
    lines = [f"Measured by `{result['command']}` on {machine_text(result['machine'])}. "
             f"A: {side(co[A])}; B: {side(co[B])}. Model `{result['model']}`, "
             f"{result['prompt_tokens']}-token prompts, exactly {result['output_tokens']} "
             "output tokens, greedy, the lean client; both graphs up at once, taking turns. "
             "B/A per pair: above 1 for tok/s, below 1 for TTFT, is B faster.", "",
             "| measure | A: other | B: this | B/A per pair: median (q1-q3) |",
             "|---|---|---|---|"]
    for level in result["levels"]:
        c = level["concurrency"]
        what = f"{level['pairs']} pairs" if c == 1 else f"{level['pairs']} pairs of waves"
        lines.append(f"| c={c} output tok/s ({what}) | {level[A]:.1f} | {level[B]:.1f} | "
                     f"{ratio(level['ratio'])} |")
    for kind in ("cold", "hit"):
        cached = (f", cached {pre[A]['cached_tokens']:.0f} / {pre[B]['cached_tokens']:.0f}"
                  if kind == "hit" else "")
        lines.append(f"| {kind} TTFT ({result['prefix_tokens']}-token prefix, "
                     f"{pre['prefixes']} prefixes{cached}) | "
                     f"{pre[A][f'{kind}_ttft_s'] * 1000:.1f} ms | "
                     f"{pre[B][f'{kind}_ttft_s'] * 1000:.1f} ms | "
                     f"{ratio(pre[f'{kind}_ratio'])} |")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving.checkouts",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--other", required=True, type=Path,
                   help="root of the other checkout (A); this one is B")
    p.add_argument("--model", default="qwen3-small", help="built-in model both serve")
    p.add_argument("--pairs", type=int, default=12, help="pairs of requests at c = 1")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--waves", type=int, default=6, help="pairs of waves at each c > 1")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--prefix-tokens", type=int, default=1500)
    p.add_argument("--prefixes", type=int, default=6, help="distinct prefixes, each cold + hit")
    p.add_argument("--blas", default="auto", help="runtime.blas of both graphs")
    p.add_argument("--set", action="append", default=[], help="launch --set for both graphs")
    p.add_argument("--json", default="", help="write the result here too")
    args = p.parse_args(argv)
    args.other = args.other.expanduser().resolve()
    if not (args.other / "configs" / "qwen.toml").is_file():
        p.error(f"--other {args.other} is no checkout of this repository "
                "(no configs/qwen.toml)")
    for name in ("pairs", "waves", "prefixes"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if min(args.concurrency) < 1:
        p.error(f"--concurrency levels must be at least 1, got {args.concurrency}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from models.builtin import ensure_builtin
    from models.tokenizer import load_tokenizer

    model_dir = str(ensure_builtin(args.model, progress=True))
    prompts = plan(PromptMaker(load_tokenizer(model_dir)), args)
    roots = {A: args.other, B: ROOT}
    checkouts = {side: checkout(root) for side, root in roots.items()}  # the code that runs
    with contextlib.ExitStack() as stack:
        targets = {side: stack.enter_context(served(root, model_dir, args.blas, args.set))
                   for side, root in roots.items()}
        measured = asyncio.run(measure(targets, prompts, args))
    result = {"command": "python -m benchmarks.serving.checkouts "
                         + " ".join(argv if argv is not None else sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(),
              "checkouts": checkouts,
              "model": args.model, "model_dir": model_dir,
              "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
              "prefix_tokens": args.prefix_tokens, **measured}
    print(markdown(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
