"""The engine's decode step in process, beside mlx-lm's bare loop: what one step costs the host.

    python -m benchmarks.kernels.pipeline_step [--model qwen3-small] [--batch 1 16 64]
        [--prompt-tokens 256] [--output-tokens 128] [--blas auto]

The real scheduler core and the real runner core, with no sockets, in the order the runner
actor's overlap loop uses: schedule step N+1 and launch it, finishing step N (reading its
tokens back, handing the result to the scheduler) where the launch first waits on MLX values
(pipeline.before_host_sync: on the CPU, before it queues the step, except a plain decode step
of a compiled attention-only model, runner.early_queue), else right after the launch.
`launch` excludes that finish. Each part is timed per decode step of the full batch (the
median over the steps after a warm-up), beside benchmarks/kernels/forward.py's bare pipelined
loop at the same batch. Run with the decode forward compiled and eager. `queue` is
the part of `launch` spent inside mx.async_eval (MLX queueing, and on the CPU computing, the
graph); the rest of `launch` is Python building it.

How to read it: where the device computes asynchronously (a GPU), a launch that takes longer
than the bare step means the host builds and queues the step more slowly than the device runs
it, and `finish` near zero means the device was idle waiting. On the CPU, MLX computes most
of a step inside the launch, so the launch holds the forward itself.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

from actors.model_runner.cpu import blas  # imports nothing heavy: mlx must come after blas.load()

PARTS = ("schedule", "launch", "queue", "finish", "on_result", "step")
WARMUP = 5


def served(path: str, batch: int, prompt_tokens: int, output_tokens: int,
           compiled: bool) -> dict[str, float]:
    """Median milliseconds per full-batch decode step of each part (PARTS)."""
    import mlx.core as mx

    from actors.model_runner.loading import load_model
    from actors.model_runner.runner import ModelRunner
    from actors.scheduler.core import Scheduler
    from actors.scheduler.prefix_plan import plan_prefix
    from benchmarks.kernels.forward import make_prompts
    from models.info import read_model_info
    from protocol import messages as m
    from protocol.config import RuntimeConfig

    info = read_model_info(path)
    slots = batch * (prompt_tokens + output_tokens + 64)
    states = 4 * batch if info.state_layers else 0
    runner = ModelRunner(load_model(path), batch, kv_slots=slots, state_slots=states,
                         vocab_size=info.vocab_size, eos_ids=info.eos_ids,
                         runtime=RuntimeConfig(compile_decode=compiled), compile_decode=compiled)
    plan = plan_prefix(runner.layers.kinds, False)
    sched = Scheduler(max_running=batch, chunked_prefill_size=max(512, prompt_tokens),
                      kv_slots=slots, context_length=info.context_length, eos_ids=info.eos_ids,
                      prefix_cache=plan.prefix, share_groups=plan.share_groups,
                      state_slots=states, head_input=runner.head_input)
    for i, ids in enumerate(make_prompts(batch, prompt_tokens, info.vocab_size, seed=3)):
        sched.add(f"r{i}", ids.tolist(),
                  m.SamplingParams(max_new_tokens=output_tokens, ignore_eos=True))
    times: dict[str, list[float]] = {p: [] for p in PARTS}
    queued = [0.0]  # this step's seconds inside mx.async_eval
    async_eval = mx.async_eval

    def timed_async_eval(*args: Any) -> None:
        begun = time.perf_counter()
        try:
            async_eval(*args)
        finally:
            queued[0] += time.perf_counter() - begun

    mx.async_eval = timed_async_eval  # the runner calls it through the module: time it there
    try:
        _loop(sched, runner, batch, times, queued)
    finally:
        mx.async_eval = async_eval
    return {p: statistics.median(v[WARMUP:] or v) * 1e3 for p, v in times.items() if v}


def _loop(sched: Any, runner: Any, batch: int, times: dict[str, list[float]],
          queued: list[float]) -> None:
    from actors.model_runner.pipeline import flush_before_host_sync

    pending, last = None, time.perf_counter()
    while True:
        queued[0] = 0.0
        t0 = time.perf_counter()
        step = sched.schedule() if len(sched.futures) < 2 else None
        t1 = time.perf_counter()
        done: list[tuple[Any, float, float]] = []  # (result, finish s, on_result s)

        def flush() -> None:
            nonlocal pending
            if pending is None:
                return
            begun = time.perf_counter()
            result = runner.finish(pending)
            read = time.perf_counter()
            sched.on_result(result)
            done.append((result, read - begun, time.perf_counter() - read))
            pending = None

        # As the actor's Pipeline: step N is read back before step N+1 is queued, so step N's
        # arrays (the page pools it read) are free for step N+1's writes to take over.
        with flush_before_host_sync(flush):
            launched = runner.launch(step) if step is not None else None
        t2 = time.perf_counter()
        inside = bool(done)  # the launch read step N back itself
        flush()
        if done:
            result, finish_s, on_result_s = done[0]
            end = time.perf_counter()
            if len(result.tokens) == batch and step is not None and all(step.future):
                launch_s = t2 - t1 - (finish_s + on_result_s if inside else 0.0)
                for part, dt in zip(PARTS, (t1 - t0, launch_s, queued[0], finish_s,
                                            on_result_s, end - last)):
                    times[part].append(dt)
            last = end
        pending = launched
        if pending is None and sched.idle:
            break


def bare_ms(path: str, batch: int, prompt_tokens: int, output_tokens: int) -> float:
    from actors.model_runner.loading import load_model
    from benchmarks.kernels.forward import make_prompts, run_batch
    from models.info import read_model_info

    prompts = make_prompts(batch, prompt_tokens, read_model_info(path).vocab_size)
    run = run_batch(load_model(path), prompts, output_tokens)
    return statistics.median(run.step_s[WARMUP:] or run.step_s) * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-small", help="a built-in (models/builtin.py)")
    p.add_argument("--model-path", default=None, help="a local mlx-lm model directory instead")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=128)
    p.add_argument("--blas", default="auto")
    args = p.parse_args(argv)
    blas.load(args.blas)
    import mlx.core as mx

    from models.builtin import ensure_builtin

    path = args.model_path or str(ensure_builtin(args.model))
    print(f"{args.model_path or args.model} on {mx.default_device()}, prompts of "
          f"{args.prompt_tokens} tokens, {args.output_tokens} out; ms per full-batch decode step")
    print("| batch | decode | bare step | " + " | ".join(PARTS) + " | step / bare |")
    print("|---|---|---|" + "---|" * (len(PARTS) + 1))
    for batch in args.batch:
        bare = bare_ms(path, batch, args.prompt_tokens, args.output_tokens)
        for compiled in (True, False):
            got: dict[str, Any] = served(path, batch, args.prompt_tokens, args.output_tokens,
                                         compiled)
            print(f"| {batch} | {'compiled' if compiled else 'eager'} | {bare:.2f} | "
                  + " | ".join(f"{got.get(part, float('nan')):.2f}" for part in PARTS)
                  + f" | {got['step'] / bare:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
