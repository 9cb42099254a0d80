"""The bare-model ceiling: how fast mlx-lm alone runs a model at a given batch size, no server.

    python -m benchmarks.kernels.forward --model-path DIR --batch-sizes 1 2 4 8 16 \
        --prompt-tokens 256 --output-tokens 128 --blas auto --json OUT.json

For each batch size B, B distinct fixed prompts of the same length are prefilled together into
one mlx-lm prompt cache, then decoded greedily one [B, 1] step at a time. Every output token
counts, the first one included (it comes out of the prefill), so there are output_tokens - 1
decode steps. It is the ceiling for the engine because nothing runs but the forward passes:
no scheduling, no sockets, no sampling beyond argmax, every row the same length (no padding,
no masks), and the decode loop is pipelined as mlx_lm.generate's is (step n+1 is queued with
async_eval before step n's tokens are read), so the host's own work hides behind the model's.
The tokens are still read back every step, as any server must to stream them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from actors.model_runner.cpu import blas  # imports nothing heavy: mlx must come after blas.load()


@dataclass
class Run:
    prefill_s: float
    step_s: list[float]  # one per decode step: from the last token read to this one
    tokens: list[list[int]]  # per row, every output token


def make_prompts(batch: int, length: int, vocab_size: int, seed: int = 0) -> np.ndarray:
    """Fixed ids in [1000, min(100000, vocab)): ordinary tokens, away from specials."""
    high = min(100_000, vocab_size)
    return np.random.default_rng(seed).integers(1000, high, size=(batch, length), dtype=np.int32)


def run_batch(model: Any, prompts: np.ndarray, steps: int, pipeline: bool = True) -> Run:
    """Prefill `prompts` [B, P] then `steps` greedy decode steps; the caller has loaded mlx."""
    import mlx.core as mx
    from mlx_lm.generate import generation_stream
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)

    def step(tokens: mx.array) -> mx.array:  # [B, 1] in, [B, 1] out
        return mx.argmax(model(tokens, cache=cache)[:, -1, :], axis=-1)[:, None]

    ids = mx.array(prompts)
    out: list[list[int]] = []
    with mx.stream(generation_stream):
        start = time.perf_counter()
        # As mlx_lm does: all but the last token fill the cache only, so the [B, P, vocab]
        # logits are never computed; the last token's step gives the first output token.
        if ids.shape[1] > 1:
            model(ids[:, :-1], cache=cache)
            mx.eval([c.state for c in cache])
        current = step(ids[:, -1:])
        out.append(current.tolist())
        last = time.perf_counter()
        prefill_s, step_s = last - start, []
        current = step(current)
        for n in range(steps):
            upcoming = step(current) if n + 1 < steps else None  # built from the lazy step n
            if pipeline and upcoming is not None:
                mx.async_eval(upcoming)  # runs step n, then n+1, while we wait and build n+2
            out.append(current.tolist())
            now = time.perf_counter()
            step_s.append(now - last)
            last, current = now, upcoming
    tokens = [[int(col[r][0]) for col in out] for r in range(prompts.shape[0])]
    return Run(prefill_s=prefill_s, step_s=step_s, tokens=tokens)


def measure(model_path: str, batch_sizes: Sequence[int], prompt_tokens: int,
            output_tokens: int, pipeline: bool = True) -> dict:
    """The ceiling at each batch size (the caller has loaded the BLAS: blas.load)."""
    if prompt_tokens < 1 or output_tokens < 2:
        raise ValueError("need prompt_tokens >= 1 and output_tokens >= 2")
    import mlx.core as mx

    from actors.model_runner.loading import load_model
    from models.info import read_model_info

    vocab = read_model_info(model_path).vocab_size
    if vocab <= 1000:
        raise ValueError(f"vocab size {vocab} is too small for the prompt id range")
    model = load_model(model_path)
    steps = output_tokens - 1
    results = []
    for batch in batch_sizes:
        prompts = make_prompts(batch, prompt_tokens, vocab)
        run_batch(model, prompts, 2, pipeline)  # untimed: first-call allocations at these shapes
        mx.clear_cache()
        run = run_batch(model, prompts, steps, pipeline)
        decode_s = sum(run.step_s)
        row = {"batch": batch, "prefill_s": round(run.prefill_s, 4),
               "prefill_tok_s": round(batch * prompt_tokens / run.prefill_s, 1),
               "decode_s": round(decode_s, 4),
               "step_ms_mean": round(1000 * decode_s / steps, 3),
               "step_ms_median": round(1000 * statistics.median(run.step_s), 3),
               "decode_tok_s": round(batch * steps / decode_s, 1)}
        results.append(row)
        print(f"batch {batch}: prefill {row['prefill_s']:.3f} s "
              f"({row['prefill_tok_s']:.0f} tok/s), decode {steps} steps "
              f"{row['step_ms_median']:.2f} ms median "
              f"({row['decode_tok_s']:.0f} tok/s)", file=sys.stderr)
        del run
        mx.clear_cache()
    return {"model": model_path, "blas": blas.in_use(), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "decode_steps": steps, "pipeline": pipeline,
            "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.forward",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="an mlx-lm model directory")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--blas", choices=blas.CHOICES, default="auto")
    p.add_argument("--no-pipeline", action="store_true",
                   help="wait for each step before building the next (to see what async_eval buys)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    blas.load(args.blas)  # before anything imports mlx
    report = measure(args.model_path, args.batch_sizes, args.prompt_tokens, args.output_tokens,
                     pipeline=not args.no_pipeline)
    text = json.dumps(report, indent=2)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
