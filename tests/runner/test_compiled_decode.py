"""The compiled decode forward (actors/model_runner/compiled_decode.py) on real built-in models
driven by the real scheduler core: the same tokens as the eager forward and as mlx-lm, in
float32 and 4-bit, greedy (the greedy head's capture) and sampled (the model's own head); a
bounded number of traces however long the rows grow; a forward that cannot be traced falls
back to the eager one without losing the step."""

import mlx.core as mx
import mlx.nn as nn
import pytest

from actors.model_runner.compiled_decode import CompiledDecode
from actors.model_runner.cpu import weights
from actors.model_runner.loading import load_model
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from models.builtin import ensure_builtin
from models.info import read_model_info
from protocol import messages as m
from protocol.config import RuntimeConfig
from harness.oracle import Oracle
from tests.support.drive import drive

PROMPTS = ["Hello world", "def f(x):\n    return", "The quick brown fox jumps over the lazy dog."]

pytestmark = pytest.mark.skipif(
    CompiledDecode.why_not(weights.load_kernels()[0]) is not None,
    reason="the compiled kernels are not built")


@pytest.fixture(scope="module",
                params=["qwen3-tiny", "qwen3-tiny-4bit", "qwen3_5-tiny", "qwen3_5-tiny-4bit"])
def model(request, model_cache):
    path = str(ensure_builtin(request.param, cache_dir=model_cache, progress=False))
    return path, Oracle(path), read_model_info(path)


def serve(path, info, arrivals, compile_decode, model=None, depth=2):
    runner = ModelRunner(model or load_model(path), 3, kv_slots=1 << 14,
                         runtime=RuntimeConfig(compile_decode=compile_decode))
    sched = Scheduler(max_running=3, chunked_prefill_size=16, kv_slots=1 << 14,
                      context_length=info.context_length, eos_ids=info.eos_ids,
                      output_reserve=64)
    tokens, _, _ = drive(sched, runner, arrivals, depth)
    return tokens, runner


def arrivals_of(oracle, n=40, params=None):
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    many = n if params is None else params
    # Rows join and leave at different steps (the positions change), and the first one
    # decodes past three pages of 16 tokens (the table widens).
    return {0: [("a", ids[0], many)], 2: [("b", ids[1], 9)], 5: [("c", ids[2], 14)]}


def test_greedy_tokens_match_eager_and_mlx_lm(model):
    path, oracle, info = model
    arrivals = arrivals_of(oracle)
    compiled, runner = serve(path, info, arrivals, True)
    eager, plain = serve(path, info, arrivals, False)
    assert plain.compiled is None
    assert runner.compiled.off is None and runner.compiled.calls > 20
    # Rows 1-3 by table widths of 1, 2 and 4 pages (powers of two), plus a trace or two as
    # rows end: not one per step, nor one per page.
    assert runner.compiled.traces <= 12, runner.compiled.traces
    assert compiled == eager
    for reqs in arrivals.values():
        for rid, prompt, n in reqs:
            oracle.check(prompt, compiled[rid], oracle.greedy(prompt, n))


def test_sampled_rows_run_the_models_own_head_compiled(model):
    """Seeded sampling takes the model's head (no greedy capture): the same draws compiled
    as eager, the trace of that head mode its own."""
    path, oracle, info = model
    params = m.SamplingParams(max_new_tokens=20, temperature=0.8, seed=7)
    arrivals = arrivals_of(oracle, params=params)
    compiled, runner = serve(path, info, arrivals, True)
    eager, _ = serve(path, info, arrivals, False)
    assert runner.compiled.off is None and runner.compiled.calls > 10
    assert compiled == eager


class Peek(nn.Module):
    """The final norm, reading a value back first: fine eagerly, impossible in a trace."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def __call__(self, x):
        float(x[0, 0, 0].item())
        return self.norm(x)


def test_a_forward_that_cannot_trace_runs_eagerly(model):
    path, oracle, info = model
    arrivals = arrivals_of(oracle, n=12)
    net = load_model(path)
    net.model.norm = Peek(net.model.norm)
    got, runner = serve(path, info, arrivals, True, model=net)
    assert runner.compiled.off is not None and runner.compiled.calls == 0
    assert not runner.rows.decode.positions.round_pages
    for reqs in arrivals.values():
        for rid, prompt, n in reqs:
            oracle.check(prompt, got[rid], oracle.greedy(prompt, n))
    mx.clear_cache()


def test_traces_stay_few_after_the_batch_empties(model):
    """Every row leaving resets the decode batch's buffers, not the page rounding that keeps
    a long row from retracing at every new page: row b alone grows to 9 pages of 16 tokens
    after row a has come and gone, traced at widths 1, 2, 4, 8 and 16 pages, not 1 to 9."""
    path, oracle, info = model
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    arrivals = {0: [("a", ids[0], 5)], 30: [("b", ids[1], 130)]}
    got, runner = serve(path, info, arrivals, True)
    assert runner.compiled.off is None and runner.compiled.calls > 120
    assert runner.compiled.traces <= 6, runner.compiled.traces
    for reqs in arrivals.values():
        for rid, prompt, n in reqs:
            oracle.check(prompt, got[rid], oracle.greedy(prompt, n))


def test_a_model_with_sliding_windows_decodes_eagerly_without_rounding(model_cache):
    """Its windows batch as mlx-lm's merged caches, which never trace: no compiled decode,
    and no page table rounded up for nothing."""
    path = str(ensure_builtin("gemma3-tiny", cache_dir=model_cache, progress=False))
    runner = ModelRunner(load_model(path), 3, kv_slots=1 << 12,
                         runtime=RuntimeConfig(compile_decode=True))
    assert runner.layers.windows
    assert runner.compiled is None
    assert not runner.rows.decode.positions.round_pages
    assert "other than full attention" in CompiledDecode.why_not(weights.load_kernels()[0],
                                                                 runner.layers.kinds)
