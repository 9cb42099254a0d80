"""The skinny-matmul path (actors/model_runner/cpu/skinny.py) against MLX's own x @ W.T, on the
shapes of a model's linear layers and of a tied LM head, for 1-128 rows, and on whole decode
steps of a model (same tokens asserted).

    python -m benchmarks.kernels.skinny [--model-path DIR] [--blas auto]
"""

from __future__ import annotations

import argparse
import sys
import time

from actors.model_runner.cpu import blas


def median_ms(f, reps: int) -> float:
    """Median ms of f() evaluated, after one warm-up call (benchmarks.kernels.* share it)."""
    import mlx.core as mx

    mx.eval(f())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        mx.eval(f())
        times.append(time.perf_counter() - start)
    return 1000 * sorted(times)[reps // 2]


def shapes(rows: list[int]) -> None:
    import mlx.core as mx

    for d_in, d_out in ((512, 1536), (1536, 512), (1024, 3072), (512, 151936)):
        w = mx.random.normal((d_out, d_in)) * 0.02
        mx.eval(w)
        reps = 5 if d_out > 100_000 else 20
        for n in rows:
            x = mx.random.normal((n, d_in))
            mx.eval(x)
            plain = median_ms(lambda: x @ w.T, reps)
            fast = median_ms(lambda: (w @ x.T).T, reps)
            print(f"{d_in:>5} -> {d_out:<6} rows {n:>3}: x @ W.T {plain:8.2f} ms, "
                  f"(W @ x.T).T {fast:8.2f} ms, ratio {fast / plain:.2f}")


def decode(model_path: str, batches: list[int], steps: int = 40) -> None:
    """Whole decode steps (forward.py's loop) with and without the skinny path."""
    import statistics

    from actors.model_runner.cpu import skinny
    from actors.model_runner.loading import load_model
    from benchmarks.kernels.forward import make_prompts, run_batch
    from models.info import read_model_info

    plain, fast = load_model(model_path), load_model(model_path)
    skinny.apply(fast)
    vocab = read_model_info(model_path).vocab_size
    for b in batches:
        prompts = make_prompts(b, 256, vocab)
        p, f = run_batch(plain, prompts, steps), run_batch(fast, prompts, steps)
        same = sum(x == y for x, y in zip(p.tokens, f.tokens))
        p_ms, f_ms = (1000 * statistics.median(r.step_s) for r in (p, f))
        print(f"decode batch {b:>2}: mlx-lm {p_ms:7.1f} ms/step, skinny {f_ms:7.1f} ms/step, "
              f"ratio {f_ms / p_ms:.2f}, identical rows {same}/{b}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.skinny",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", default="", help="also time whole decode steps")
    p.add_argument("--blas", choices=blas.CHOICES, default="auto")
    args = p.parse_args(argv)
    print(f"blas: {blas.load(args.blas)}")
    shapes([1, 2, 4, 16, 64, 128])
    if args.model_path:
        decode(args.model_path, [1, 4, 16])
    return 0


if __name__ == "__main__":
    sys.exit(main())
