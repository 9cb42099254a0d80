"""The skinny-matmul path (actors/model_runner/skinny.py) against MLX's own x @ W.T, on the
shapes of a model's linear layers and of a tied LM head, for 1-128 rows, and on whole decode
steps of a model (same tokens asserted).

    python -m launch.bench_skinny [--model-path DIR] [--blas auto]
"""

from __future__ import annotations

import argparse
import sys
import time

from actors.model_runner import blas


def _median_ms(f, reps: int) -> float:
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
            plain = _median_ms(lambda: x @ w.T, reps)
            fast = _median_ms(lambda: (w @ x.T).T, reps)
            print(f"{d_in:>5} -> {d_out:<6} rows {n:>3}: x @ W.T {plain:8.2f} ms, "
                  f"(W @ x.T).T {fast:8.2f} ms, ratio {fast / plain:.2f}")


def decode(model_path: str, batches: list[int], steps: int = 40) -> None:
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from actors.model_runner import skinny
    from actors.model_runner.loading import load_model

    def run(model, b: int) -> tuple[float, list]:
        prompt = mx.array([[1000 + (7 * r + 13 * i) % 50000 for i in range(256)]
                           for r in range(b)])
        cache = make_prompt_cache(model)
        model(prompt[:, :-1], cache=cache)
        mx.eval([c.state for c in cache])
        token, times, tokens = prompt[:, -1:], [], []
        for _ in range(steps):
            start = time.perf_counter()
            token = mx.argmax(model(token, cache=cache)[:, -1, :], axis=-1)[:, None]
            tokens.append(token.tolist())
            times.append(time.perf_counter() - start)
        return 1000 * sorted(times)[steps // 2], tokens

    plain, fast = load_model(model_path), load_model(model_path)
    skinny.apply(fast)
    for b in batches:
        (p, pt), (f, ft) = run(plain, b), run(fast, b)
        same = sum(x == y for x, y in zip(pt, ft))
        print(f"decode batch {b:>2}: mlx-lm {p:7.1f} ms/step, skinny {f:7.1f} ms/step, "
              f"ratio {f / p:.2f}, identical steps {same}/{steps}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench_skinny", description=__doc__.split("\n\n")[0])
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
