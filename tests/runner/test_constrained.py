"""Constrained rows inside the batch, on the real runner and scheduler cores and real built-in
models: a JSON-schema or regex row's output always matches its constraint, with overlap or
not, resumed after retraction or not; its unconstrained neighbours keep mlx-lm's greedy
tokens, as if they ran alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from actors.constraints import compile_constraint
from actors.model_runner.loading import load_model
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from models.builtin import ensure_builtin
from models.info import read_model_info
from protocol import messages as m
from protocol.config import RuntimeConfig
from harness.oracle import Oracle
from tests.support.drive import drive
from tests.support.schemas import SCHEMAS

PROMPTS = ["Hello world", "Give me a JSON object:", "def f(x):\n    return",
           "The quick brown fox jumps over the lazy dog. " * 6]
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-[0-3][0-9]"


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3_5-tiny"])
def setup(request, model_cache):
    path = str(ensure_builtin(request.param, cache_dir=model_cache, progress=False))
    return path, Oracle(path), read_model_info(path)


def _run(path, info, arrivals, depth, max_rows=4, kv_slots=1 << 16, reserve=64, runtime=None,
         runners=None):
    states = 4 * max_rows if info.state_layers else 0
    runner = ModelRunner(load_model(path), max_rows, kv_slots=kv_slots, state_slots=states,
                         eos_ids=info.eos_ids, tokenizer_dir=path,
                         **({} if runtime is None else {"runtime": runtime}))
    if runners is not None:
        runners.append(runner)
    sched = Scheduler(max_running=max_rows, chunked_prefill_size=16, kv_slots=kv_slots,
                      context_length=info.context_length, eos_ids=info.eos_ids,
                      output_reserve=reserve, state_slots=states)
    tokens, finished, _ = drive(sched, runner, arrivals, depth, ticks=4000)
    return tokens, finished, sched


def _text(oracle, info, tokens, finish):
    assert finish.reason == "stop", finish  # the grammar ended it, not max_new_tokens
    assert tokens[-1] in info.eos_ids
    return oracle.tokenizer.decode(tokens[:-1])


def _params(kind, source="", max_new_tokens=200):
    return m.SamplingParams(max_new_tokens=max_new_tokens, constraint_kind=kind,
                            constraint=compile_constraint(kind, source))


def _schema(k):
    return _params("json_schema", json.dumps(SCHEMAS[k]))


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_constrained_rows_match_and_their_neighbours_keep_greedy_tokens(setup, depth):
    path, oracle, info = setup
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    regex = _params("regex", DATE, max_new_tokens=40)
    anything = _params("json_schema", '{"type": "object"}')
    arrivals = {0: [("plain0", ids[0], 12), ("json0", ids[1], _schema(0))],
                2: [("regex", ids[2], regex), ("plain1", ids[3], 9)],
                5: [("json1", ids[0], _schema(1)), ("object", ids[3], anything)]}
    tokens, finished, _ = _run(path, info, arrivals, depth)
    for rid, prompt in (("plain0", ids[0]), ("plain1", ids[3])):
        n = len(tokens[rid])
        oracle.check(prompt, tokens[rid], oracle.greedy(prompt, n))
    for rid, k in (("json0", 0), ("json1", 1)):
        jsonschema.validate(json.loads(_text(oracle, info, tokens[rid], finished[rid])),
                            SCHEMAS[k])
    assert re.fullmatch(DATE, _text(oracle, info, tokens["regex"], finished["regex"]))
    assert isinstance(json.loads(_text(oracle, info, tokens["object"], finished["object"])),
                      dict)


@pytest.mark.parametrize("depth", [1, 2], ids=["plain", "overlap"])
def test_the_greedy_head_takes_constrained_greedy_rows_with_the_same_tokens(setup, depth):
    """Greedy constrained rows beside plain ones: the greedy head finds each row's argmax over
    what its grammar allows, from the masks, without the logits (no full sampling call), and
    gives the tokens the logits path gives (masked logits, argmax)."""
    path, oracle, info = setup
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    arrivals = {0: [("json0", ids[1], _schema(0)), ("plain0", ids[0], 12)],
                3: [("regex", ids[2], _params("regex", DATE, max_new_tokens=40)),
                    ("json1", ids[3], _schema(1))]}
    runners = []
    fast, fast_end, _ = _run(path, info, arrivals, depth, runners=runners)
    slow, slow_end, _ = _run(path, info, arrivals, depth, runtime=RuntimeConfig(greedy_head=False),
                             runners=runners)
    assert runners[0].cpu.greedy is not None and runners[1].cpu.greedy is None
    assert fast == slow and fast_end == slow_end
    assert runners[0].sampler.full_calls == 0 and runners[1].sampler.full_calls > 0
    jsonschema.validate(json.loads(_text(oracle, info, fast["json1"], fast_end["json1"])),
                        SCHEMAS[1])


def test_a_constrained_row_resumed_after_retraction_still_matches(setup):
    """A KV budget too small for three rows retracts one; the resumed constrained row's
    matcher is rebuilt from its output so far."""
    path, oracle, info = setup
    ids = [oracle.tokenizer.encode(p) for p in PROMPTS]
    ids = [oracle.tokenizer.encode(p * 8)[:20] for p in PROMPTS]
    arrivals = {0: [(f"json{k}", ids[k], _schema(k % 2)) for k in range(3)]}
    tokens, finished, sched = _run(path, info, arrivals, depth=2, max_rows=3, kv_slots=80,
                                   reserve=0)
    assert sched.retractions > 0, "the budget was meant to force retraction"
    for k in range(3):
        rid = f"json{k}"
        jsonschema.validate(json.loads(_text(oracle, info, tokens[rid], finished[rid])),
                            SCHEMAS[k % 2])
