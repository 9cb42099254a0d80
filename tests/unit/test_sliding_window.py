"""Sliding-window attention (gemma3-tiny: a RotatingKVCache of 32 positions in layers 0 and 2,
full attention in 1 and 3) in the runner core, driven by the real scheduler core built the way
the scheduler actor builds it from the runner's layer kinds (prefix cache asked for, so turned
off): prompts several windows long, prefilled in chunks beside running decodes, rows joining
and leaving the batch, n choices of one prompt. Greedy tokens are mlx-lm's; no KV op is sent."""


import pytest

from models.builtin import ensure_builtin
from actors.model_runner.loading import load_model
from models.info import read_model_info
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from tests.e2e.oracle import Oracle
from tests.unit.drive import drive

WINDOW = 32


@pytest.fixture(scope="module")
def gemma(model_cache):
    path = str(ensure_builtin("gemma3-tiny", cache_dir=model_cache, progress=False))
    return path, Oracle(path), read_model_info(path)


def serve(path, info, arrivals, depth, chunk, max_rows=4):
    """arrivals: step -> [(rid, ids, max_new, group)]. Returns (rid -> tokens, batches)."""
    runner = ModelRunner(load_model(path), max_rows, kv_slots=1 << 14)
    plan = plan_prefix(runner.layers.kinds, True)
    sched = Scheduler(max_running=max_rows, chunked_prefill_size=chunk, kv_slots=1 << 14,
                      context_length=info.context_length, eos_ids=info.eos_ids,
                      prefix_cache=plan.prefix, share_groups=plan.share_groups)
    tokens, finished, batches = drive(sched, runner, arrivals, depth)
    assert all(fin.reason == "length" for fin in finished.values()), finished
    return tokens, batches


def _arrivals(oracle):
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 20
    ids = oracle.tokenizer.encode(text)
    # Below, at and far past the window; the last two arrive while others decode.
    return {0: [("short", ids[:10], 40, ""), ("edge", ids[5:5 + WINDOW + 1], 12, "")],
            3: [("long", ids[:150], 36, ""), ("mid", ids[20:100], 20, "")],
            9: [(f"choice{k}", ids[40:120], 16, "n") for k in range(3)],
            14: [("again", ids[:150], 36, "")]}


@pytest.mark.parametrize("depth, chunk", [(1, 16), (2, 16), (2, 512)],
                         ids=["plain-chunk16", "overlap-chunk16", "overlap-whole"])
def test_sliding_window_batches_match_mlx_lm_and_send_no_kv_ops(gemma, depth, chunk):
    path, oracle, info = gemma
    arrivals = _arrivals(oracle)
    got, batches = serve(path, info, arrivals, depth, chunk)
    assert [op for b in batches for op in b.ops] == []
    for reqs in arrivals.values():
        for rid, prompt, n, _ in reqs:
            oracle.check(prompt, got[rid], oracle.greedy(prompt, n))
