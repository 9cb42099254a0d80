"""Prompt logprobs (echo): the real scheduler core and runner core score the prompt's tokens
inside the normal prefill, and every position equals mlx-lm's own log_softmax over the same
tokens (harness/oracle.py prompt_logprobs) within 1e-4: alone, chunked, beside decoding
rows (overlap), after a prefix-cache hit on part of the prompt, with retraction; dense and
hybrid. Requests that do not ask keep mlx-lm's greedy tokens and get no scores."""

import numpy as np
import pytest

from actors.model_runner.loading import load_model
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from models.builtin import ensure_builtin
from models.info import read_model_info
from protocol import messages as m
from harness.oracle import Oracle
from tests.support.drive import drive

TEXT = ("The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun. "
        "Meanwhile, far away, a small robot counts the stars one by one.")


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3_5-tiny"])
def setup(request, model_cache):
    path = str(ensure_builtin(request.param, cache_dir=model_cache, progress=False))
    return path, Oracle(path), read_model_info(path)


def run(path, info, arrivals, depth=1, chunk=64, prefix=False, kv_slots=1 << 14, reserve=64):
    states = 16 if info.state_layers else 0
    runner = ModelRunner(load_model(path), 3, kv_slots=kv_slots, state_slots=states)
    sched = Scheduler(max_running=3, chunked_prefill_size=chunk, kv_slots=kv_slots,
                      context_length=info.context_length, eos_ids=info.eos_ids,
                      output_reserve=reserve, prefix_cache=prefix, state_slots=states,
                      head_input=runner.head_input)
    scores: dict[str, m.PromptScores] = {}
    tokens, finished, batches = drive(sched, runner, arrivals, depth, scores=scores)
    return tokens, finished, scores, sched, batches


def scored(n, start=0, top=0):
    return m.SamplingParams(max_new_tokens=n, logprobs=True, top_logprobs=top,
                            prompt_logprobs_from=start)


def check(oracle, ids, got: m.PromptScores, start=0, top=0):
    want, best = oracle.prompt_logprobs(ids)
    first = max(start, 1)
    assert got.start == first
    assert len(got.logprobs) == len(ids) - first
    np.testing.assert_allclose(got.logprobs, want[first - 1:], atol=1e-4, rtol=1e-5)
    if top:
        assert all(len(t) == top for t in got.top_ids)
        for k, (tids, tlps) in enumerate(zip(got.top_ids, got.top_logprobs)):
            assert tlps == sorted(tlps, reverse=True)
            if best[first - 1 + k] != tids[0]:  # a near tie only
                assert tlps[0] - tlps[1] < 1e-4
            if ids[first + k] in tids:  # the prompt token among them, with its own logprob
                assert abs(tlps[tids.index(ids[first + k])] - got.logprobs[k]) < 1e-5


@pytest.mark.parametrize("chunk", [64, 7], ids=["whole", "chunked"])
@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_prompt_scores_equal_mlx_lms_log_softmax(setup, chunk, depth):
    path, oracle, info = setup
    ids = oracle.tokenizer.encode(TEXT)
    other = oracle.tokenizer.encode("Hello world, how are")
    # A plain request decodes beside the scored one's chunks.
    arrivals = {0: [("plain", other, 12)], 2: [("scored", ids, scored(4, top=3))]}
    tokens, _, scores, _, batches = run(path, info, arrivals, depth=depth, chunk=chunk)
    assert set(scores) == {"scored"}  # only the request that asked
    check(oracle, ids, scores["scored"], top=3)
    oracle.check(other, tokens["plain"], oracle.greedy(other, 12))
    oracle.check(ids, tokens["scored"], oracle.greedy(ids, 4))
    if chunk < len(ids):
        assert sum(1 for b in batches if b.score_rows) >= len(ids) // chunk


def test_scoring_from_a_position_after_a_prefix_hit(setup):
    """A hit may cover the positions before the first one scored, never one scored."""
    path, oracle, info = setup
    ids = oracle.tokenizer.encode(TEXT)
    start = len(ids) // 2
    arrivals = {0: [("warm", ids, 3)], 8: [("scored", ids, scored(3, start=start))],
                16: [("all", ids, scored(3, start=0))]}
    tokens, finished, scores, _, _ = run(path, info, arrivals, chunk=8, prefix=True)
    assert 0 < finished["scored"].cached_tokens <= start - 1
    assert finished["all"].cached_tokens == 0
    check(oracle, ids, scores["scored"], start=start)
    check(oracle, ids, scores["all"])
    for rid in ("warm", "scored", "all"):
        oracle.check(ids, tokens[rid], oracle.greedy(ids, 3))


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_retraction_keeps_the_scores_of_the_first_pass(setup, depth):
    path, oracle, info = setup
    ids = oracle.tokenizer.encode(TEXT)[:24]
    other = [oracle.tokenizer.encode(p * 5)[:24] for p in ("Hello world ", "One two ")]
    arrivals = {0: [("a", other[0], 30), ("b", other[1], 30), ("s", ids, scored(30))]}
    tokens, _, scores, sched, _ = run(path, info, arrivals, depth=depth, chunk=16,
                                      kv_slots=120, reserve=0)
    assert sched.retractions > 0
    check(oracle, ids, scores["s"])
    oracle.check(ids, tokens["s"], oracle.greedy(ids, 30))
