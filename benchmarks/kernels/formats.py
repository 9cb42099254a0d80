"""Decode steps of one model in each stored format, side by side in one run: float32, 4-bit,
8-bit and bf16 variants of a built-in (made by mlx_lm.convert, models/formats.py), each with the
runner's CPU patches (actors/model_runner/cpu/) and each weight strategy asked for (auto: our
kernels where built; mlx: MLX's own kernels; jit; resident). Bare forwards with a KV cache of
`--context` tokens, no engine around them; ms per step, median of `--steps`, and the ratio to
float32 at the same batch.

    python -m benchmarks.kernels.formats [--model qwen3-small] [--batch 1 16]
        [--formats f32 4bit 8bit bf16] [--strategies auto mlx]
"""

from __future__ import annotations

import argparse
import statistics
import time

from actors.model_runner.cpu import blas


def step_ms(model, batch: int, context: int, steps: int) -> float:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[5] * context] * batch), cache=cache))
    token = mx.array([[7]] * batch)
    for _ in range(2):
        mx.eval(model(token, cache=cache))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        mx.eval(model(token, cache=cache))
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def load(name: str, strategy: str):
    from actors.model_runner import cpu
    from actors.model_runner.loading import load_model
    from models.builtin import ensure_builtin
    from protocol.config import RuntimeConfig

    model = load_model(str(ensure_builtin(name, progress=True)))
    installed = cpu.install(model, RuntimeConfig(weights=strategy), vocab_size=0)
    return model, installed.weights


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.formats")
    p.add_argument("--model", default="qwen3-small", help="a built-in (models/builtin.py)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--formats", nargs="+", default=["f32", "4bit", "8bit", "bf16"])
    p.add_argument("--strategies", nargs="+", default=["auto", "mlx"])
    p.add_argument("--context", type=int, default=128)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blas", default="auto")
    args = p.parse_args(argv)
    blas.load(args.blas)
    print(f"{args.model}, BLAS {blas.in_use()}, context {args.context}, median of "
          f"{args.steps} steps")
    float32: dict[int, float] = {}
    for fmt in args.formats:
        name = args.model if fmt == "f32" else f"{args.model}-{fmt}"
        for strategy in (["auto"] if fmt == "f32" else args.strategies):
            model, plan = load(name, strategy)
            kinds = ", ".join(f"{k}: {p.strategy}" for k, p in plan.kinds.items())
            cells = []
            for b in args.batch:
                ms = step_ms(model, b, args.context, args.steps)
                if fmt == "f32":
                    float32[b] = ms
                ratio = f" ({float32[b] / ms:.2f}x f32)" if b in float32 else ""
                cells.append(f"batch {b}: {ms:7.1f} ms{ratio}")
            print(f"{fmt:>5} {strategy:<9} {' | '.join(cells)}   [{kinds}]", flush=True)


if __name__ == "__main__":
    main()
