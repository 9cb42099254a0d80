"""Sliding-window attention (gemma3-tiny: a RotatingKVCache of 32 positions in layers 0 and 2,
full attention in 1 and 3) in the runner core, driven by the real scheduler core built the way
the scheduler actor builds it from the runner's layer kinds: prompts several windows long,
prefilled in chunks beside running decodes, rows joining and leaving the batch, n choices of
one prompt, with the prefix cache off and on (a radix node restores the full layers from KV
slots and the sliding layers from a window snapshot in a state slot: windows.py). Greedy tokens
are mlx-lm's; repeated prompts hit."""


import pytest

from models.builtin import ensure_builtin
from actors.model_runner.loading import load_model
from models.info import read_model_info
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from harness.oracle import Oracle
from tests.support.drive import drive

WINDOW = 32


@pytest.fixture(scope="module")
def gemma(model_cache):
    path = str(ensure_builtin("gemma3-tiny", cache_dir=model_cache, progress=False))
    return path, Oracle(path), read_model_info(path)


def serve(path, info, arrivals, depth, chunk, prefix, max_rows=4):
    """arrivals: step -> [(rid, ids, max_new, group)]. Returns (rid -> tokens, rid -> Finish,
    batches)."""
    states = 4 * max_rows
    runner = ModelRunner(load_model(path), max_rows, kv_slots=1 << 14, state_slots=states)
    plan = plan_prefix(runner.layers.kinds, prefix)
    assert not plan.blocked  # sliding layers are restorable (from state slots)
    sched = Scheduler(max_running=max_rows, chunked_prefill_size=chunk, kv_slots=1 << 14,
                      context_length=info.context_length, eos_ids=info.eos_ids,
                      prefix_cache=plan.prefix, share_groups=plan.share_groups,
                      state_slots=states, snapshot_interval=16 if prefix else 0,
                      head_input=runner.head_input)
    tokens, finished, batches = drive(sched, runner, arrivals, depth)
    assert all(fin.reason == "length" for fin in finished.values()), finished
    return tokens, finished, batches


def _arrivals(oracle):
    text = "The quick brown fox jumps over the lazy dog while the cat sleeps. " * 20
    ids = oracle.tokenizer.encode(text)
    # Below, at and far past the window; the last two arrive while others decode.
    return {0: [("short", ids[:10], 40, ""), ("edge", ids[5:5 + WINDOW + 1], 12, "")],
            3: [("long", ids[:150], 36, ""), ("mid", ids[20:100], 20, "")],
            9: [(f"choice{k}", ids[40:120], 16, "n") for k in range(3)],
            14: [("again", ids[:150], 36, "")]}


@pytest.mark.parametrize("prefix", [False, True], ids=["prefix-off", "prefix-on"])
@pytest.mark.parametrize("depth, chunk", [(1, 16), (2, 16), (2, 512)],
                         ids=["plain-chunk16", "overlap-chunk16", "overlap-whole"])
def test_sliding_window_batches_match_mlx_lm(gemma, depth, chunk, prefix):
    path, oracle, info = gemma
    arrivals = _arrivals(oracle)
    got, finished, batches = serve(path, info, arrivals, depth, chunk, prefix)
    for reqs in arrivals.values():
        for rid, prompt, n, _ in reqs:
            oracle.check(prompt, got[rid], oracle.greedy(prompt, n))
    cached = {rid: fin.cached_tokens for rid, fin in finished.items()}
    # "again" is "long" sent again (150 tokens): it resumes far past the window; "long" itself
    # starts with "short"'s whole prompt. The n choices of one prompt share it through the
    # tree with or without the prefix cache.
    if prefix:
        assert cached["again"] >= 2 * WINDOW and cached["long"] == 10
    else:
        assert cached["again"] == cached["long"] == 0
    first, *others = sorted(cached[f"choice{k}"] for k in range(3))
    assert first == 0 and all(c > 0 for c in others), cached
