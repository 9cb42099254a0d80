"""The greedy head (actors/model_runner/cpu/greedy_head.py) against the product it stands in
for, argmax(x @ W.T), on an LM head's shape: float32 (the int8 copy) and 4-bit and 8-bit
heads (their own codes), by rows of x. Same tokens asserted.

    python -m benchmarks.kernels.greedy_head [--vocab 151936] [--hidden 512] [--rows 1 4 16 32]
"""

from __future__ import annotations

import argparse

from actors.model_runner.cpu import blas
from benchmarks.kernels.skinny import median_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.greedy_head")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16, 32])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--blas", default="auto")
    args = p.parse_args(argv)
    blas.load(args.blas)
    import mlx.core as mx
    import mas_kernels as mk

    from actors.model_runner.cpu import greedy_head as gh

    mx.random.seed(0)
    w = mx.random.normal((args.vocab, args.hidden)) * 0.05
    heads = {"f32": (gh.GreedyHead(w, mk), lambda x: x @ w.T)}
    for bits in (4, 8):
        codes, scales, biases = mx.quantize(w, group_size=args.group_size, bits=bits)
        q = gh.Quantized(codes, scales, biases, args.group_size, bits)
        heads[f"{bits}bit"] = (gh.GreedyHead(q, mk), lambda x, c=codes, s=scales, b=biases,
                               n=bits: mk.affine_qmm(x, c, s, b, args.group_size, n))
    print(f"head {args.vocab} x {args.hidden}, BLAS {blas.in_use()}, kernels {mk.isa()}, "
          f"quantized screening vectorized: {mk.qhead_fast()}; ms, median")
    print(f"{'format':>6} {'rows':>5} {'greedy head':>12} {'product + argmax':>17} {'ratio':>6}")
    for name, (head, product) in heads.items():
        for rows in args.rows:
            x = mx.random.normal((rows, args.hidden))
            mx.eval(x)
            full = lambda: mx.argmax(product(x), axis=-1)  # noqa: E731
            assert head.tokens(x).tolist() == full().tolist()
            a, b = median_ms(lambda: head.tokens(x), 15), median_ms(full, 15)
            print(f"{name:>6} {rows:>5} {a:12.2f} {b:17.2f} {b / a:6.2f}")


if __name__ == "__main__":
    main()
