"""Drives the real scheduler core and the real runner core together, step by step, as the two
actors would (without sockets), through the scheduler tests' one loop (tests/support/driver.py)."""

from __future__ import annotations

from actors.model_runner.loading import load_model
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from protocol.config import RuntimeConfig
from tests.support.driver import Driver


def drive(sched, runner, arrivals, depth=1, ticks=3000, scores=None):
    """The real runner through the one loop (tests/support/driver.py). arrivals: step ->
    [(rid, ids, max_new or SamplingParams[, group])]. depth 2 plays the overlap loop: step N+1
    is built before step N's result is processed. Returns (rid -> tokens, rid -> Finish, the
    ForwardBatches sent); every request finished once, nothing leaked. `scores`: a dict that
    gets each request's prompt scores (PromptScores), where asked."""
    d = Driver(sched, runner, depth).run(arrivals, limit=ticks)
    assert scores is not None or not d.scores, "prompt scores nobody asked for"
    if scores is not None:
        scores.update(d.scores)
    assert not any(sched.leaks().values()), sched.leaks()
    assert set(d.finished) == {a[0] for reqs in arrivals.values() for a in reqs}
    return d.tokens, d.finished, d.batches


def run(path, info, arrivals, max_rows=3, depth=1, kv_slots=1 << 16, chunk=16, reserve=64,
        prefix=False, head_input=True, runtime=RuntimeConfig(), prefill_first=False):
    """arrivals: step -> [(rid, ids, max_new)]. depth 2 plays the overlap loop: step N+1 is
    built before step N's result is processed. head_input: where the runner supports it (a
    hybrid model), as the actors agree on it (ModelLayers.head_input). Returns (rid -> tokens,
    scheduler); the scheduler keeps the batches sent (`batches`)."""
    states = 4 * max_rows if info.state_layers else 0
    runner = ModelRunner(load_model(path), max_rows, kv_slots=kv_slots, state_slots=states,
                         runtime=runtime)
    plan = plan_prefix(runner.layers.kinds, prefix)  # as the scheduler actor builds its core
    sched = Scheduler(max_running=max_rows, chunked_prefill_size=chunk, kv_slots=kv_slots,
                      context_length=info.context_length, eos_ids=info.eos_ids,
                      output_reserve=reserve, prefix_cache=plan.prefix,
                      share_groups=plan.share_groups, state_slots=states,
                      head_input=head_input and runner.head_input, prefill_first=prefill_first)
    assert runner.head_input == bool(info.state_layers)  # qwen3_5's head: nothing after it
    tokens, sched.finished, sched.batches = drive(sched, runner, arrivals, depth, ticks=2000)
    return tokens, sched


def check_all(oracle, arrivals, got):
    for reqs in arrivals.values():
        for rid, prompt, n in reqs:
            oracle.check(prompt, got[rid], oracle.greedy(prompt, n))
