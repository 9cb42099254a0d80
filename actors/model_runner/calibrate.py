"""How the decode step's throughput grows with the batch, for this model on this machine: what
`scheduler.max_running_requests = "auto"` is capped by (launch/sizing.py).

The launcher runs it in a process of its own (`python -m actors.model_runner.calibrate`, the
config on stdin as JSON), so only runner-like processes ever import MLX, and caches the
answer. The model is loaded and patched as the runner loads it (BLAS, CPU layer, greedy
head); rows of CONTEXT tokens join the runner's decode batch (decode_batch.DecodeBatch, all
rows copies of one prompt cache), and at each batch size a few greedy decode steps are timed
as the runner runs them (the greedy head's tokens where it is installed, else an argmax).
The batch does not advance: every timed step sees the same context.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

LADDER = (8, 16, 32, 64, 128, 256)
CONTEXT = 64  # tokens each calibration row holds
# Timed steps per batch size, after one untimed: at least REPEAT and MIN_SECONDS of them (a
# tiny model's steps take milliseconds); the fastest is kept, the least disturbed.
REPEAT = 3
MIN_SECONDS = 0.2
BUDGET_S = 4.0  # a launch waits this long at most (plus one ladder step) for the measurement


def decode_rates(model: Any, installed: Any, ladder: tuple[int, ...] = LADDER,
                 context: int = CONTEXT, repeat: int = REPEAT,
                 budget_s: float = BUDGET_S) -> dict[int, float]:
    """Output tokens per second of a greedy decode step at each batch size of `ladder`, up to
    the first batch size at which the calibration has run for `budget_s`."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    from actors.model_runner.cpu import greedy_head
    from actors.model_runner.decode_batch import standalone

    prompt = make_prompt_cache(model)
    mx.eval(model(mx.array([[5 + i % 997 for i in range(context)]]), cache=prompt))
    decode, rows = standalone(prompt), 0
    # Distinct tokens: rows that differ, as served rows do (the greedy head checks the
    # candidates of every row; identical rows would share theirs).
    token_buf = mx.arange(1000, 1001 + max(ladder), dtype=mx.int32)

    def step() -> mx.array:
        with installed.steps():
            if installed.greedy is None:
                logits = model(decode.inputs(token_buf), cache=decode.caches)
                return mx.argmax(logits[:, -1, :], axis=-1)
            with greedy_head.capture() as got:
                model(decode.inputs(token_buf), cache=decode.caches)
            return installed.greedy.tokens(got.hidden[:, -1, :])

    rates, began = {}, time.perf_counter()
    for batch in sorted(ladder):
        while rows < batch:
            rows += 1
            decode.join_copy(rows, prompt)
        mx.eval(step())
        took: list[float] = []
        while len(took) < repeat or (sum(took) < MIN_SECONDS and len(took) < 30):
            start = time.perf_counter()
            mx.eval(step())
            took.append(time.perf_counter() - start)
        rates[batch] = batch / min(took)
        if time.perf_counter() - began > budget_s:
            break  # a slow model's larger batches are not measured: it is capped here
    return rates


def main() -> int:
    """stdin: {"config": the Config as JSON, "path": the model folder}; stdout: the rates."""
    import msgspec

    from protocol.config import Config

    job = json.loads(sys.stdin.read())
    cfg = msgspec.convert(job["config"], Config)
    from actors.model_runner.entry import share_cores

    share_cores(cfg)  # the cores one runner process gets
    from actors.model_runner.cpu import blas

    blas.load(cfg.runtime.blas)
    from actors.model_runner import cpu
    from actors.model_runner.loading import load_model

    from models.info import read_model_info

    model = load_model(job["path"])
    installed = cpu.install(model, cfg.runtime, read_model_info(job["path"]).vocab_size)
    started = time.perf_counter()
    rates = decode_rates(model, installed)
    print(json.dumps({"rates": {str(b): round(r, 1) for b, r in rates.items()},
                      "seconds": round(time.perf_counter() - started, 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
