"""The NumPy softmax and SiLU (actors/model_runner/cpu/fastmath.py) against MLX's own, on whole
prefills and decode steps of a model (forward.py's loop; same greedy tokens asserted).
Both sides use the skinny matmuls, as the runner does: only fastmath differs.

    python -m benchmarks.kernels.fastmath --model-path DIR [--blas auto]
"""

from __future__ import annotations

import argparse
import statistics
import sys

from actors.model_runner.cpu import blas


def compare(model_path: str, lengths: list[int], batches: list[int], steps: int = 24) -> None:
    from actors.model_runner.cpu import fastmath, skinny
    from actors.model_runner.loading import load_model
    from benchmarks.kernels.forward import make_prompts, run_batch
    from models.info import read_model_info

    model = load_model(model_path)
    skinny.apply(model)
    fastmath.install(model)
    vocab = read_model_info(model_path).vocab_size

    def both(prompts, n):
        runs = []
        for on in (False, True):
            with fastmath.active(on):
                run_batch(model, prompts, 2)  # untimed: first calls at these shapes
                runs.append(run_batch(model, prompts, n))
        return runs

    for length in lengths:
        stock, fast = both(make_prompts(1, length, vocab), 2)
        print(f"prefill {length:>5} tokens: mlx {1000 * stock.prefill_s:8.1f} ms, numpy "
              f"{1000 * fast.prefill_s:8.1f} ms, speedup {stock.prefill_s / fast.prefill_s:.2f}x, "
              f"same tokens {stock.tokens == fast.tokens}")
    for b in batches:
        stock, fast = both(make_prompts(b, 256, vocab), steps)
        s_ms, f_ms = (1000 * statistics.median(r.step_s) for r in (stock, fast))
        same = sum(x == y for x, y in zip(stock.tokens, fast.tokens))
        print(f"decode batch {b:>2}: mlx {s_ms:7.1f} ms/step, numpy {f_ms:7.1f} ms/step, "
              f"speedup {s_ms / f_ms:.2f}x, identical rows {same}/{b}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.kernels.fastmath",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--model-path", required=True, help="an mlx-lm model directory")
    p.add_argument("--blas", choices=blas.CHOICES, default="auto")
    args = p.parse_args(argv)
    print(f"blas: {blas.load(args.blas)}")
    compare(args.model_path, [128, 256, 512, 1024, 2048], [1, 4, 16])
    return 0


if __name__ == "__main__":
    sys.exit(main())
