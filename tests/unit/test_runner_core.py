"""The runner core driven by the real scheduler core (no sockets) on real built-in models:
requests joining and leaving the batch at different steps still get mlx-lm's greedy tokens,
for the dense (qwen3) and the hybrid (qwen3_5) model."""

import pytest

from actors.model_runner.builtin import ensure_builtin
from actors.model_runner.loading import load_model, read_model_info
from actors.model_runner.runner import ModelRunner, StepError
from actors.scheduler.core import Scheduler
from protocol import messages as m
from tests.e2e.oracle import Oracle

PROMPTS = ["Hello world", "中文的自然语言处理", "def f(x):\n    return", "🎉🚀 emoji",
           "The quick brown fox jumps over the lazy dog. " * 20]


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3_5-tiny"])
def setup(request, model_cache):
    path = str(ensure_builtin(request.param, cache_dir=model_cache, progress=False))
    oracle = Oracle(path)
    return path, oracle, read_model_info(path)


def run(path, info, arrivals, max_rows=3):
    """arrivals: step -> [(rid, ids, max_new)]. Returns rid -> tokens."""
    sched = Scheduler(max_running=max_rows, max_prefill_tokens=64,
                      context_length=info.context_length, eos_ids=info.eos_ids)
    runner = ModelRunner(load_model(path), max_rows)
    tokens, finished = {}, {}
    for step in range(500):
        for rid, ids, n in arrivals.get(step, []):
            sched.add(rid, ids, m.SamplingParams(max_new_tokens=n))
        batch = sched.schedule()
        if batch is None and sched.idle and step > max(arrivals):
            break
        if batch is not None:
            out = sched.on_result(runner.step(batch))
            for rid, toks in out.tokens.items():
                tokens.setdefault(rid, []).extend(toks)
            finished.update({f.rid: f for f in out.finished})
    assert sched.leaks() == {"rows": [], "requests": []}
    assert set(finished) == {rid for reqs in arrivals.values() for rid, _, _ in reqs}
    return tokens


def test_staggered_batch_matches_mlx_lm(setup):
    path, oracle, info = setup
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    # Five requests through three rows, arriving at different steps, with different lengths:
    # rows are reused and the batched cache is filtered and extended many times.
    arrivals = {0: [("a", ids[0], 12), ("b", ids[1], 5)], 3: [("c", ids[2], 9)],
                4: [("d", ids[3], 7)], 6: [("e", ids[4], 10)]}
    got = run(path, info, arrivals)
    for reqs in arrivals.values():
        for rid, prompt, n in reqs:
            oracle.check(prompt, got[rid], oracle.greedy(prompt, n))


def test_a_decode_row_that_was_never_prefilled_is_refused(setup):
    path, _, _ = setup
    runner = ModelRunner(load_model(path), 2)
    batch = m.ForwardBatch(step=1, rows=[1], input_lens=[1], start_pos=[5], future=[True],
                           sample=[True], input_ids=b"")
    with pytest.raises(StepError, match="never prefilled"):
        runner.step(batch)
