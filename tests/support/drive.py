"""Drives the real scheduler core and the real runner core together, step by step, as the two
actors would (without sockets): the loop the runner-core tests share."""

from __future__ import annotations

from collections import deque

from actors.model_runner.loading import load_model
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from protocol import messages as m
from protocol.config import RuntimeConfig


def drive(sched, runner, arrivals, depth=1, ticks=3000, scores=None):
    """arrivals: step -> [(rid, ids, max_new or SamplingParams[, group])]. depth 2 plays the overlap loop: step
    N+1 is built before step N's result is processed. Returns (rid -> tokens, rid -> Finish,
    the ForwardBatches sent); every request finished once, nothing leaked. `scores`: a dict
    that gets each request's prompt scores (m.PromptScores), where asked."""
    tokens, finished, results, batches = {}, {}, deque(), []
    for tick in range(ticks):
        for rid, ids, n, *group in arrivals.get(tick, []):
            params = n if isinstance(n, m.SamplingParams) else m.SamplingParams(max_new_tokens=n)
            sched.add(rid, ids, params, group=group[0] if group else "")
        while len(sched.futures) < depth and (batch := sched.schedule()) is not None:
            batches.append(batch)
            results.append(runner.step(batch))
        if not results:
            if sched.idle and tick > max(arrivals):
                break
            continue
        out = sched.on_result(results.popleft())
        for rid, toks in out.tokens.items():
            tokens.setdefault(rid, []).extend(toks)
        for rid, got in out.prompt_scores.items():
            assert scores is not None and rid not in scores
            scores[rid] = got
        for fin in out.finished:
            assert fin.rid not in finished
            finished[fin.rid] = fin
    assert not any(sched.leaks().values()), sched.leaks()
    assert set(finished) == {a[0] for reqs in arrivals.values() for a in reqs}
    return tokens, finished, batches


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
