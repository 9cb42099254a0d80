"""A gated-delta layer's recurrence: the compiled kernel (mas_kernels.gated_delta), mlx-lm's
per-token loop and the blocks of actors/model_runner/chunked_delta.py, by block size.

    python -m benchmarks.kernels.gated_delta [--tokens 2 8 128 512 2000] [--blocks 32 64 128 256]

One layer of Qwen3.5-0.8B's shape by default (16 key and value heads, dims 128), random
unit-norm keys, gates in (0.9, 1). Median ms of the repeats; the loop is skipped past
--loop-max tokens (it costs ~1 ms a token there).
"""

from __future__ import annotations

import argparse

from actors.model_runner.cpu import blas
from benchmarks.kernels.skinny import median_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.gated_delta")
    p.add_argument("--tokens", type=int, nargs="+", default=[2, 8, 128, 512, 2000])
    p.add_argument("--blocks", type=int, nargs="+", default=[32, 64, 128, 256])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--loop-max", type=int, default=512)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--blas", default="auto")
    args = p.parse_args(argv)
    blas.load(args.blas)
    import mlx.core as mx
    from mlx_lm.models import gated_delta
    from mlx_lm.models.gated_delta import normalize_qk

    from actors.model_runner.chunked_delta import BLOCK, chunked_gated_delta

    try:
        import mas_kernels as kernels
    except ImportError:  # not built: the blocks and the loop only
        kernels = None
    loop = getattr(gated_delta.gated_delta_ops, "reference", gated_delta.gated_delta_ops)
    h, d = args.heads, args.dim
    print(f"gated delta, {h} heads, dims {d}: ms per layer")
    print(f"{'tokens':>7} {'kernel':>9} {'loop':>9} "
          + " ".join(f"{f'block {b}':>10}" for b in args.blocks))
    for t in args.tokens:
        q, k = normalize_qk(mx.random.normal((1, t, h, d)), mx.random.normal((1, t, h, d)),
                            inv_scale=d**-0.5, eps=1e-6)
        v = mx.random.normal((1, t, h, d))
        g, beta = mx.random.uniform(0.9, 1.0, (1, t, h)), mx.random.uniform(0, 1, (1, t, h))
        state = mx.zeros((1, h, d, d))
        mx.eval(q, k, v, g, beta)
        ms = (f"{median_ms(lambda: loop(q, k, v, g, beta, state), args.repeat):9.2f}"
              if t <= args.loop_max else f"{'-':>9}")
        own = f"{'-':>9}"
        if kernels is not None:
            x = median_ms(lambda: kernels.gated_delta(q, k, v, g, beta, state), args.repeat)
            own = f"{x:9.2f}"
        blocks = [median_ms(lambda b=b: chunked_gated_delta(q, k, v, g, beta, state, block=b),
                            args.repeat) for b in args.blocks]
        print(f"{t:>7} {own} {ms} " + " ".join(f"{x:10.2f}" for x in blocks))
    print(f"(the runner uses the kernel where it is built, else blocks of {BLOCK} from two "
          "tokens on)")


if __name__ == "__main__":
    main()
