"""The benchmark: this server vs mlx_lm.server vs a bare mlx-lm forward loop, on one machine and
one model, in one run (machines are noisy: only ratios from one run are compared).

    python -m benchmarks.serving [--model qwen3-small | --model-path DIR]
                                 [--concurrency 1 2 4 8 16] [--prompt-tokens 256]
                                 [--output-tokens 128] [--out docs/bench]

Each server runs alone on the machine, in turn, driven through the same OpenAI streaming
endpoint with the same deterministic prompts:
- sweep: closed-loop concurrency levels, prompt_tokens in, exactly output_tokens out;
- shared prefix: a 2,000-token common prefix with different suffixes (cold vs cached TTFT);
- prefill interference: long prompts arriving while others decode (ITL of the decoders).
The bare ceiling is benchmarks/kernels/forward.py (a tight mlx-lm forward loop, no server) at
the same batch sizes. Writes results.json and throughput.png under --out, and BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from benchmarks.serving.load import PromptMaker, Target, closed_loop, one, pct, summarize
from benchmarks.serving.report import write_markdown, write_plot
from benchmarks.serving.servers import mlx_lm_server, ours, vllm_mlx_server
from harness.graph import ROOT
from launch.sizing import cpu_name

PREFIX_TOKENS, PREFIX_HITS, LONG_PROMPTS = 2000, 6, 2


class Plan:
    """Every prompt of the run, made once, so both servers get exactly the same ones."""

    def __init__(self, maker: PromptMaker, args: argparse.Namespace):
        self.args = args
        p, levels = args.prompt_tokens, args.concurrency
        self.sweep = {c: [maker.make(p, seed=1000 * c + k) for k in range(self.count(c))]
                      for c in levels}
        prefix = maker.make(PREFIX_TOKENS, seed=7)
        self.prefix = [prefix + maker.make(32, seed=70 + k) for k in range(PREFIX_HITS + 1)]
        self.background = [maker.make(p, seed=900 + k) for k in range(args.interference_streams)]
        self.long = [maker.make(PREFIX_TOKENS, seed=950 + k) for k in range(LONG_PROMPTS)]
        self.warmup = [maker.make(p, seed=1)]

    @staticmethod
    def count(c: int) -> int:
        return max(4, 2 * c)  # at least two waves (each gives a steady decode rate)

    @property
    def requests(self) -> int:
        return (sum(len(v) for v in self.sweep.values()) + len(self.prefix)
                + len(self.background) + len(self.long) + len(self.warmup))


async def drive(target: Target, plan: Plan, bar: tqdm) -> dict[str, Any]:
    args, out = plan.args, {}
    step = lambda: bar.update(1)  # noqa: E731
    await closed_loop(target, plan.warmup, 1, 8, step)
    out["sweep"] = []
    for c, prompts in plan.sweep.items():
        bar.set_postfix_str(f"{target.name} c={c}")
        samples, wall = await closed_loop(target, prompts, c, args.output_tokens, step)
        out["sweep"].append(summarize(samples, wall, c))
    bar.set_postfix_str(f"{target.name} shared prefix")
    cold, _ = await closed_loop(target, plan.prefix[:1], 1, 8, step)
    hits, _ = await closed_loop(target, plan.prefix[1:], 1, 8, step)
    out["prefix"] = {"prefix_tokens": PREFIX_TOKENS, "cold_ttft_s": cold[0].ttft,
                     "hit_ttft_p50_s": pct([s.ttft for s in hits], 50),
                     "errors": sum(bool(s.error) for s in cold + hits)}
    out["prefix"]["ratio"] = out["prefix"]["hit_ttft_p50_s"] / out["prefix"]["cold_ttft_s"]
    out["interference"] = await interference(target, plan, step)
    return out


async def interference(target: Target, plan: Plan, step) -> dict[str, Any]:
    """Decoding streams, then long prompts sent once they all stream: the decoders' token gaps
    while the long prompts prefill, against their gaps before."""
    args, n = plan.args, len(plan.background)
    client = target.client()
    begun, streaming = asyncio.Event(), [0]

    def first() -> None:
        streaming[0] += 1
        if streaming[0] == n:
            begun.set()

    tasks = [asyncio.ensure_future(one(client, target, p, args.output_tokens, first))
             for p in plan.background]
    await asyncio.wait_for(begun.wait(), 600)
    await asyncio.sleep(0.5)  # some undisturbed steps first
    started = time.perf_counter()
    long, _ = await closed_loop(target, plan.long, len(plan.long), 8, step)
    ended = time.perf_counter()
    samples = await asyncio.gather(*tasks)
    await client.close()
    for _ in samples:
        step()
    during = [b - a for s in samples for a, b in zip(s.chunks, s.chunks[1:])
              if a < ended and b > started]
    before = [b - a for s in samples for a, b in zip(s.chunks, s.chunks[1:]) if b <= started]
    return {"streams": n, "long_prompts": len(plan.long), "long_prompt_tokens": PREFIX_TOKENS,
            "long_ttft_p50_s": pct([s.ttft for s in long], 50),
            "itl_before_p50_s": pct(before, 50), "itl_during_p50_s": pct(during, 50),
            "itl_during_p99_s": pct(during, 99),
            "itl_during_max_s": max(during) if during else float("nan"),
            "errors": sum(bool(s.error) for s in samples + long)}


def bare_forward(model_dir: str, args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        subprocess.run([sys.executable, "-m", "benchmarks.kernels.forward",
                        "--model-path", model_dir, "--batch-sizes", *map(str, args.concurrency),
                        "--prompt-tokens", str(args.prompt_tokens),
                        "--output-tokens", str(args.output_tokens), "--blas", args.blas,
                        "--json", f.name], check=True, cwd=ROOT)
        return json.loads(Path(f.name).read_text())


def add_model_args(p: argparse.ArgumentParser) -> None:
    """The options resolve_model() and our server read: which model, and how we run it."""
    p.add_argument("--model", default="qwen3-small", help="built-in model name")
    p.add_argument("--model-path", default="", help="a local mlx-lm model directory instead")
    p.add_argument("--blas", default="auto", help="runtime.blas for every party")
    p.add_argument("--set", action="append", default=[], help="launch --set for our server")


def resolve_model(args: argparse.Namespace) -> str:
    if args.model_path:
        return str(Path(args.model_path).expanduser())
    from models.builtin import ensure_builtin

    return str(ensure_builtin(args.model, progress=True))


def machine() -> dict[str, Any]:
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "system": platform.platform(),
            "python": platform.python_version()}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving",
                                description=__doc__.split("\n\n")[0])
    add_model_args(p)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--interference-streams", type=int, default=8)
    p.add_argument("--skip-mlx-lm", action="store_true", help="only this server and bare")
    p.add_argument("--vllm-mlx", default="", metavar="PYTHON",
                   help="also vllm-mlx, run by this interpreter (a venv with vllm-mlx)")
    p.add_argument("--out", default=str(ROOT / "docs" / "bench"))
    p.add_argument("--markdown", default=str(ROOT / "BENCHMARKS.md"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from actors.model_runner.cpu import blas
    from models.info import read_model_info
    from models.tokenizer import load_tokenizer

    blas.find(args.blas)
    model_dir = resolve_model(args)
    info = read_model_info(model_dir)
    plan = Plan(PromptMaker(load_tokenizer(model_dir)), args)
    command = "python -m benchmarks.serving " + " ".join(argv if argv is not None else sys.argv[1:])
    results: dict[str, Any] = {
        "command": command.strip(), "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine(), "model": args.model_path or args.model, "blas": blas.find(args.blas)
        or "bundled", "prompt_tokens": args.prompt_tokens, "output_tokens": args.output_tokens,
        "concurrency": args.concurrency, "servers": {}}
    servers = [("mlx-actor-serve", lambda: ours(model_dir, args.blas, args.set))]
    if not args.skip_mlx_lm:
        servers.append(("mlx_lm.server", lambda: mlx_lm_server(model_dir, args.blas,
                                                               info.eos_ids)))
    if args.vllm_mlx:
        servers.append(("vllm-mlx", lambda: vllm_mlx_server(args.vllm_mlx, model_dir,
                                                            blas.find(args.blas), info.eos_ids)))
    print(f"bench: bare forward loop on {results['model']} ...", file=sys.stderr, flush=True)
    results["bare"] = bare_forward(model_dir, args)
    with tqdm(total=plan.requests * len(servers), unit="req", desc="bench") as bar:
        for name, start in servers:
            bar.set_postfix_str(f"starting {name}")
            with start() as target:
                results["servers"][name] = asyncio.run(drive(target, plan, bar))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    text = write_markdown(results, Path(args.markdown), out / "throughput.png")
    write_plot(results, out / "throughput.png")  # last: it needs the bench extra (matplotlib)
    print(text)
    return 0
