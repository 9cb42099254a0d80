"""The decode batch's attention: the compiled kernel against MLX's CPU attention.

    python -m benchmarks.kernels.attention [--rows 1 16] [--context 256 2000]
        [--dtype float32 bfloat16]

One layer of qwen3-small's shape (16 query heads, 4 KV heads, dim 64) over the decode batch's
page pool (decode_batch.PAGE tokens a page; each row's pages in a run, as a join takes them):
mas_kernels.decode_attention reads each row's own length through its page table. MLX's
mx.fast.scaled_dot_product_attention is timed twice: on rows already laid out contiguously
(the best MLX can do) and with the pages gathered first (what the decode forward gives it where
the kernel does not run). Median ms of 15, and the rate at which each reads the KV it needs.
In bfloat16 (a bf16 model's KV) the kernel rounds where MLX's bf16 attention rounds.
"""

from __future__ import annotations

import argparse

from actors.model_runner.cpu import blas
from benchmarks.kernels.skinny import median_ms


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.attention")
    p.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    p.add_argument("--context", type=int, nargs="+", default=[256, 2000])
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"],
                   choices=["float32", "bfloat16"])
    p.add_argument("--blas", default="auto")
    args = p.parse_args(argv)
    blas.load(args.blas)
    import mas_kernels as mk
    import mlx.core as mx

    from actors.model_runner.decode_batch import PAGE
    from actors.model_runner.kv_pages import gather

    print(f"decode attention, {args.heads} heads / {args.kv_heads} KV heads, dim {args.dim}, "
          f"kernel path {mk.isa()}")
    print(f"{'dtype':>8} {'rows':>5} {'context':>8} {'KV MB':>8} {'kernel ms':>10} {'GB/s':>6} "
          f"{'MLX ms':>8} {'GB/s':>6} {'+gather':>9} {'speedup':>8}")
    for dtype, rows, context in ((d, r, c) for d in args.dtype for r in args.rows
                                 for c in args.context):
        per_row = -(-(context + 1) // PAGE)
        # Each row's pages in a run, as a join takes them; the rows in no order.
        order = mx.random.permutation(rows)[:, None] * per_row
        table = (order + mx.arange(per_row)[None]).astype(mx.int32)
        kind = getattr(mx, dtype)
        q = mx.random.normal((rows, args.heads, 1, args.dim)).astype(kind)
        k = mx.random.normal((args.kv_heads, rows * per_row, PAGE, args.dim)).astype(kind)
        v = mx.random.normal(k.shape).astype(kind)
        lengths = mx.array([context + 1] * rows, dtype=mx.int32)
        mask = mx.ones((rows, 1, 1, per_row * PAGE), dtype=mx.bool_)
        mask[..., context + 1:] = False
        flat_k, flat_v = gather(k, table), gather(v, table)
        mx.eval(q, k, v, lengths, mask, table, flat_k, flat_v)
        ours = median_ms(lambda: mk.decode_attention(q, k, v, table, lengths, 0.125), 15)
        flat = median_ms(lambda: mx.fast.scaled_dot_product_attention(
            q, flat_k, flat_v, scale=0.125, mask=mask), 15)
        gathered = median_ms(lambda: mx.fast.scaled_dot_product_attention(
            q, gather(k, table), gather(v, table), scale=0.125,
            mask=mask), 15)
        mb = rows * args.kv_heads * (context + 1) * args.dim * kind.size * 2 / 1e6
        print(f"{dtype:>8} {rows:5d} {context:8d} {mb:8.1f} {ours:10.3f} {mb / ours:6.1f} "
              f"{flat:8.3f} {mb / flat:6.1f} {gathered:9.3f} {flat / ours:7.1f}x")


if __name__ == "__main__":
    main()
