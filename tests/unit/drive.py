"""Drives the real scheduler core and the real runner core together, step by step, as the two
actors would (without sockets): the loop the runner-core tests share."""

from __future__ import annotations

from collections import deque

from protocol import messages as m


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
