"""The prefill spike, measured on the runner core alone: what the step costs in which a long
request leaves the decode batch, against the same batch's decode steps without a departure.

    python -m benchmarks.kernels.departure --model qwen3-small --streams 8 --long 2000

The real scheduler core and runner core run together on one thread, as the actors would
(no sockets): `streams` requests of 128-token prompts decode; then one `long`-token prompt
arrives, is prefilled in chunks beside them, decodes 8 tokens and leaves. Every step's
forward time (the runner's launch to read-back) is recorded; the report gives the median
decode step before the long prompt arrived, the median decode step while it decoded, and the
step in which it left (its row released), the step that ran its last chunk (and joined it
to the decode batch) and the longest other chunk step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

from actors.model_runner.cpu import blas  # before mlx


def run(model_path: str, streams: int, long: int, chunk: int) -> dict:
    import numpy as np

    from actors.model_runner.loading import load_model
    from actors.model_runner.runner import ModelRunner
    from actors.scheduler.core import Scheduler
    from models.info import read_model_info
    from protocol import messages as m

    info = read_model_info(model_path)
    rng = np.random.default_rng(0)
    rows = streams + 1
    sched = Scheduler(max_running=rows, chunked_prefill_size=chunk, kv_slots=1 << 16,
                      context_length=info.context_length, eos_ids=(), output_reserve=64,
                      prefix_cache=False, state_slots=4 * rows if info.state_layers else 0)
    runner = ModelRunner(load_model(model_path), rows, kv_slots=1 << 16,
                         state_slots=4 * rows if info.state_layers else 0)
    params = m.SamplingParams(max_new_tokens=400, ignore_eos=True)
    for i in range(streams):
        sched.add(f"s{i}", rng.integers(1000, 50000, 128).tolist(), params)
    steps: list[tuple[str, float]] = []  # (phase, forward seconds)
    phase, long_row, join_ms = "before", None, None
    for tick in range(2000):
        if tick == 40:
            sched.add("long", rng.integers(1000, 50000, long).tolist(),
                      m.SamplingParams(max_new_tokens=8, ignore_eos=True))
            phase = "prefill"
        batch = sched.schedule()
        if batch is None:
            break
        if long_row is not None and long_row in batch.release_rows:
            phase = "departure"
        result = runner.step(batch)
        joins = long_row is not None and any(
            r == long_row and n > 1 and sample
            for r, n, sample in zip(batch.rows, batch.input_lens, batch.sample))
        if joins:  # the long prompt's last chunk: it joins the decode batch in this step
            join_ms = result.forward_s * 1e3
        decoding = all(n == 1 for n in batch.input_lens)
        if phase == "prefill" and decoding:
            phase = "with long"
        if long_row is None and "long" in sched.requests:
            long_row = sched.requests["long"].row or None  # 0: not admitted yet
        kind = "join" if joins else phase if decoding or phase == "departure" else "chunk"
        steps.append((kind, result.forward_s))
        sched.on_result(result)
        if phase == "departure":
            phase = "after"
        if phase == "after" and sum(1 for p, _ in steps if p == "after") >= 20:
            break

    def median(name: str) -> float:
        got = [s for p, s in steps if p == name]
        return statistics.median(got) * 1e3 if got else float("nan")

    leave = [s * 1e3 for p, s in steps if p == "departure"]
    report = {"model": model_path, "streams": streams, "long": long,
              "decode_before_ms": median("before"), "decode_with_long_ms": median("with long"),
              "decode_after_ms": median("after"), "departure_ms": leave[0] if leave else None,
              "last_chunk_ms": join_ms,
              "chunk_max_ms": max((s * 1e3 for p, s in steps if p == "chunk"), default=None)}
    report["departure_over_decode_with_long"] = (report["departure_ms"]
                                                 / report["decode_with_long_ms"])
    return report


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-small", help="a built-in model name")
    ap.add_argument("--model-path", help="a checkpoint directory (instead of --model)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--long", type=int, default=2000)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--blas", default="auto")
    args = ap.parse_args(argv)
    blas.load(args.blas)
    path = args.model_path
    if path is None:
        from models.builtin import ensure_builtin
        path = str(ensure_builtin(args.model))
    json.dump(run(path, args.streams, args.long, args.chunk), sys.stdout, indent=1)
    print()


if __name__ == "__main__":
    main()
