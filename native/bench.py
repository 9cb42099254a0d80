"""Microbenchmark: our kernels against float32 through MKL and MLX's own quantized matmul.

    python native/bench.py [--shapes 640x1792,2048x6144] [--rows 1,16] [--hot]
    python native/bench.py --layers [--rows 1,16]   # threading beside MKL, in a decode step

Run from the repository root so the project's BLAS loader (actors/model_runner/cpu/blas.py)
puts MKL behind MLX before MLX is imported. Milliseconds per product (median of repeats) and
GB/s of weight bytes read. Unless --hot, each timed evaluation cycles through enough copies of
the weight (>= 96 MB) that it comes from DRAM, as in a real decode step; --hot reuses one.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import statistics
import sys
import time


def load_blas() -> str:
    """MKL behind MLX: the project's loader if importable, else the same library directly."""
    here = os.path.dirname(os.path.abspath(__file__))
    # The installed mas_kernels, not this folder's sources; the repository root for blas.
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    sys.path.insert(0, os.path.dirname(here))
    try:
        from actors.model_runner.cpu import blas  # imports no MLX
        return blas.load("auto")
    except ImportError:
        import ctypes
        found = sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))
        if not found:
            return "bundled"
        os.environ.setdefault("MKL_THREADING_LAYER", "INTEL")
        ctypes.CDLL(found[-1], mode=ctypes.RTLD_GLOBAL)
        return found[-1]


SHAPES = {"640x1792": (640, 1792), "2048x6144": (2048, 6144), "1024x32768": (1024, 32768),
          "head512": (512, 151936), "head1024": (1024, 151936)}
COLD_BYTES = 96 << 20


def nbytes(arrays) -> int:
    return sum(a.nbytes for a in arrays)


def timed(mx, make, copies, budget_s=0.4, min_reps=3, max_reps=50) -> float:
    """ms per product: median over repeats of one eval of a product with every copy."""
    mx.eval([make(c) for c in copies])  # warm up (and page in)
    times = []
    start = time.perf_counter()
    while len(times) < min_reps or (time.perf_counter() - start < budget_s
                                    and len(times) < max_reps):
        t0 = time.perf_counter()
        mx.eval([make(c) for c in copies])
        times.append((time.perf_counter() - t0) / len(copies))
    return statistics.median(times) * 1e3


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", default="640x1792,2048x6144,1024x32768,head1024")
    ap.add_argument("--rows", default="1,16,32,64,256")
    ap.add_argument("--group-size", type=int, default=64)
    ap.add_argument("--hot", action="store_true", help="reuse one weight (cache-resident)")
    ap.add_argument("--no-mlx", action="store_true", help="skip mx.quantized_matmul")
    ap.add_argument("--threads", type=int, default=0, help="our threads (default: all cores)")
    ap.add_argument("--isa", default="", help="force a path: avx512, avx2, scalar")
    ap.add_argument("--layers", action="store_true",
                    help="time decode steps mixing our products with MKL float32 matmuls, "
                         "by threading setup")
    args = ap.parse_args(argv)

    blas = load_blas()
    import mlx.core as mx
    import mas_kernels as mk

    if args.threads:
        mk.set_threads(args.threads)
    if args.isa:
        mk.set_isa(args.isa)
    gs = args.group_size
    if args.layers:
        return layers(mx, mk, blas, [int(r) for r in args.rows.split(",")], gs)
    print(f"blas={os.path.basename(blas)} isa={mk.isa()} threads={mk.threads()} "
          f"group_size={gs} scales=bfloat16 {'hot' if args.hot else 'cold (weights from DRAM)'}")
    head = (f"{'K x N':>12} {'M':>4} | {'q4 ms':>7} {'GB/s':>5} | {'q8 ms':>7} {'GB/s':>5} | "
            f"{'bf16 ms':>7} {'GB/s':>5} | {'f32 mkl':>7} {'GB/s':>5} {'skinny':>7} | "
            f"{'mlx q4':>7} {'mlx bf16':>8}")
    print(head)
    print("-" * len(head))
    mx.random.seed(0)
    for name in args.shapes.split(","):
        K, N = SHAPES[name] if name in SHAPES else map(int, name.split("x"))
        w = mx.random.normal((N, K)) * 0.02
        q4 = mx.quantize(w.astype(mx.bfloat16), group_size=gs, bits=4)
        q8 = mx.quantize(w.astype(mx.bfloat16), group_size=gs, bits=8)
        wb = w.astype(mx.bfloat16)
        mx.eval(w, q4, q8, wb)

        def copies_of(arrays):
            n = 1 if args.hot else max(1, min(64, math.ceil(COLD_BYTES / nbytes(arrays))))
            # Fresh buffers with the same values (+ 0, ^ 0 make copies).
            out = [arrays] + [tuple(a ^ 0 if a.dtype == mx.uint32 else a + 0 for a in arrays)
                              for _ in range(n - 1)]
            mx.eval(out)
            return out

        c4, c8, cb, cf = (copies_of(q4), copies_of(q8), copies_of((wb,)), copies_of((w,)))
        for M in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((M, K))
            mx.eval(x)
            t4 = timed(mx, lambda c: mk.affine_qmm(x, *c, gs, 4), c4)
            t8 = timed(mx, lambda c: mk.affine_qmm(x, *c, gs, 8), c8)
            tb = timed(mx, lambda c: mk.bf16_matmul(x, c[0]), cb)
            tf = timed(mx, lambda c: x @ c[0].T, cf)
            ts = timed(mx, lambda c: (c[0] @ x.T).T, cf) if M > 1 else tf
            tq = tm = "-"
            if not args.no_mlx and M * N * K <= 2e9:  # MLX's scalar kernels: seconds past that
                tq = f"{timed(mx, lambda c: mx.quantized_matmul(x, *c, transpose=True, group_size=gs, bits=4), c4[:2], budget_s=0.2, min_reps=2):.2f}"  # noqa: E501
                tm = f"{timed(mx, lambda c: x @ c[0].T, cb[:2], budget_s=0.2, min_reps=2):.2f}"

            def gbs(arrays, ms):
                return nbytes(arrays) / ms / 1e6

            print(f"{K:>5}x{N:<6} {M:>4} | {t4:7.3f} {gbs(q4, t4):5.1f} | {t8:7.3f} "
                  f"{gbs(q8, t8):5.1f} | {tb:7.3f} {gbs((wb,), tb):5.1f} | {tf:7.3f} "
                  f"{gbs((w,), tf):5.1f} {ts:7.3f} | {tq:>7} {tm:>8}", flush=True)
        del c4, c8, cb, cf


def layers(mx, mk, blas, rows, gs, n_layers=8, rounds=7) -> None:
    """A decode step of a 2048-wide model, 4-bit weights except one float32 projection per
    layer (MKL), evaluated as one graph; ms per step by our thread count and worker spin.
    Setups run round-robin so load from other processes hits all of them alike."""
    mx.random.seed(0)

    def q(n, k):
        return mx.quantize((mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16),
                           group_size=gs, bits=4)

    net = [(q(3072, 2048), mx.random.normal((2048, 2048)) * 0.02, q(12288, 2048), q(2048, 6144))
           for _ in range(n_layers)]
    mx.eval(net)

    def step(h, with_f32=True):
        for qkv, wo, up, down in net:
            a = mk.affine_qmm(h, *qkv, gs, 4)
            if with_f32:
                h = h + a[..., :2048] @ wo.T
            u = mk.affine_qmm(h, *up, gs, 4)
            g = mx.sigmoid(u[..., :6144]) * u[..., :6144] * u[..., 6144:]
            h = h + mk.affine_qmm(g, *down, gs, 4)
        return h

    setups = {"1 thread": (1, 2000), "2 threads, no spin": (2, 0),
              "2 threads, spin 60us": (2, 2000), "2 threads, spin 700us": (2, 20000)}
    print(f"blas={os.path.basename(blas)} isa={mk.isa()} {n_layers} layers: q4 3072+12288+2048 "
          f"rows of K=2048/6144, one 2048x2048 float32 matmul (MKL) per layer; ms per step")
    for M in rows:
        x = mx.random.normal((M, 2048))
        mx.eval(x)
        times = {(name, f32): [] for name in setups for f32 in (True, False)}
        for _ in range(rounds):
            for name, (threads, spin) in setups.items():
                mk.set_threads(threads)
                mk._ext._set_spin(spin)
                for f32 in (True, False):
                    mx.eval(step(x, f32))
                    t0 = time.perf_counter()
                    for _ in range(3):
                        mx.eval(step(x, f32))
                    times[(name, f32)].append((time.perf_counter() - t0) / 3 * 1e3)
        print(f"M={M}: " + "  ".join(
            f"{name}: {statistics.median(times[(name, True)]):.2f} "
            f"(ours only {statistics.median(times[(name, False)]):.2f})" for name in setups))


if __name__ == "__main__":
    main()
