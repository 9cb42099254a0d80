"""`python -m benchmarks [--model NAME] [options]`: the benchmark a model's kind calls for,
run against a graph it starts itself.

A hybrid model (linear-attention layers keeping a recurrent state, e.g. qwen3_5-small) gets
benchmarks.serving.hybrid: prefill tokens/s at 512 and 2,000 tokens and the repeat-prompt
table. Any other model gets benchmarks.serving: throughput and latency by concurrency, ours
beside mlx_lm.server and the bare mlx-lm forward. Options after --model go to that benchmark
(its own --help lists them).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0],
                                add_help=False)
    p.add_argument("--model", default="qwen3_5-small")
    args, rest = p.parse_known_args(argv)
    if {"-h", "--help"} & set(rest) and "--model" not in (argv or sys.argv[1:]):
        print(__doc__)  # without building the default model first
        return 0
    from models.builtin import ensure_builtin
    from models.info import read_model_info

    hybrid = read_model_info(str(ensure_builtin(args.model))).state_layers > 0
    if hybrid:
        from benchmarks.serving.hybrid import main as bench
    else:
        from benchmarks.serving.run import main as bench
    print(f"python -m benchmarks: {args.model} is {'hybrid' if hybrid else 'dense'}: "
          f"{bench.__module__}", file=sys.stderr)
    return bench(["--model", args.model, *rest])


if __name__ == "__main__":
    sys.exit(main())
