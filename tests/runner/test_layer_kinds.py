"""Layer kinds at launch (runner: actors/model_runner/layers.py) and what the scheduler's radix
tree may hold for them (actors/scheduler/prefix_plan.py)."""

import mlx.nn as nn
import pytest
from mlx_lm.models.cache import (ArraysCache, CacheList, ChunkedKVCache, ConcatenateKVCache,
                                 KVCache, QuantizedKVCache)

from models.builtin import ensure_builtin
from actors.model_runner.layers import Layers, classify
from actors.model_runner.loading import load_model
from actors.model_runner.rows import StepError
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from protocol import messages as m
from protocol.codec import pack_ids, unpack_ids

EXPECTED = {
    "qwen3-tiny": ["full", "full"],
    "qwen3_5-tiny": ["recurrent", "recurrent", "recurrent", "full"],
    "gemma3-tiny": ["sliding", "full", "sliding", "full"],
}


class FakeModel(nn.Module):
    """Layers without modules the duck typing knows, and the caches it is given."""

    def __init__(self, make):
        super().__init__()
        self.make = make
        self.layers = [nn.Identity() for _ in make()]

    def make_cache(self):
        return self.make()


@pytest.fixture(scope="module")
def models(model_cache):
    return {name: load_model(str(ensure_builtin(name, model_cache, progress=False)))
            for name in EXPECTED}


@pytest.mark.parametrize("name", list(EXPECTED))
def test_builtins_are_classified_by_their_mlx_lm_caches(models, name):
    assert classify(models[name]) == EXPECTED[name]


def test_runner_lists_follow_the_kinds(models):
    runner = ModelRunner(models["gemma3-tiny"], 2, kv_slots=64)
    layers = runner.layers
    assert layers.kinds == EXPECTED["gemma3-tiny"]
    assert layers.full == [1, 3] and layers.attention == [0, 1, 2, 3]
    assert layers.linear == [] and layers.windows == [0, 2] and layers.unpooled == []
    assert layers.stateful == [0, 2]  # their windows go to the state slots
    assert runner.pools.kv.layers == [1, 3]  # the pool holds only what it can give back


@pytest.mark.parametrize("cache, name", [
    (lambda: ChunkedKVCache(16), "ChunkedKVCache"),
    (QuantizedKVCache, "QuantizedKVCache"),
    (ConcatenateKVCache, "ConcatenateKVCache"),
])
def test_a_cache_the_runner_cannot_batch_is_refused_by_layer_and_type(cache, name):
    model = FakeModel(lambda: [KVCache(), cache(), KVCache(), cache()])
    with pytest.raises(ValueError, match=rf"layers 1, 3 \({name}\)"):
        classify(model)
    with pytest.raises(ValueError, match=name):
        ModelRunner(model, 2)  # refused before the runner touches the model


def test_other_batchable_caches_are_served_as_other_kinds():
    model = FakeModel(lambda: [KVCache(), CacheList(KVCache(), ArraysCache(2))])
    assert classify(model) == ["full", "other:CacheList"]


def test_caches_that_do_not_follow_the_layers_are_refused(models):
    model = models["qwen3_5-tiny"]
    stock = type(model).make_cache
    try:
        type(model).make_cache = lambda self: stock(self)[::-1]
        with pytest.raises(ValueError, match="layer 0 is linear attention but its mlx-lm cache "
                                             "is full"):
            classify(model)
    finally:
        type(model).make_cache = stock


def _chunk_at(start: int) -> m.ForwardBatch:
    """Row 1's prompt chunk at `start`, as a prefix hit of `start` tokens would send it."""
    pages = m.Op(kind=m.OpKind.PAGES, dst=1, start=0, slots=pack_ids([1, 2]))
    return m.ForwardBatch(step=1, rows=[1], input_lens=[1], start_pos=[start], future=[False],
                          sample=[True], input_ids=pack_ids([5]), ops=[pages],
                          admit_rows=[1], admit_params=[m.SamplingParams(max_new_tokens=1)])


def test_a_prefix_on_a_sliding_window_model_without_state_slots_is_refused(models):
    runner = ModelRunner(models["gemma3-tiny"], 2, kv_slots=64)
    with pytest.raises(StepError, match=r"layers \[0, 2\] resume from a state slot and it "
                                        "has none"):
        runner.step(_chunk_at(3))


def test_a_prefix_on_a_layer_kind_no_pool_keeps_is_refused():
    from actors.model_runner.kv_pages import KvPages
    from actors.model_runner.storage import Pools

    pools = Pools(Layers.of(["full", "other:CacheList"]), KvPages([0]), None)
    with pytest.raises(StepError, match=r"layers \[1\] \(other:CacheList\) cannot be given "
                                        "a prefix back"):
        pools.restore(1, [None, None], 3, [1], None)


# -- what the scheduler's tree may hold --------------------------------------------------------


@pytest.mark.parametrize("kinds", [EXPECTED["qwen3-tiny"], EXPECTED["qwen3_5-tiny"],
                                   EXPECTED["gemma3-tiny"]])
@pytest.mark.parametrize("wanted", [True, False])
def test_full_recurrent_and_sliding_layers_keep_the_configured_prefix_cache(kinds, wanted):
    plan = plan_prefix(kinds, wanted)
    assert (plan.prefix, plan.share_groups, plan.blocked, plan.reason) == (wanted, True, {}, "")


def test_other_kinds_turn_the_tree_off_and_are_named():
    plan = plan_prefix(["full", "other:CacheList", "sliding"], True)
    assert not plan.prefix and not plan.share_groups
    assert plan.blocked == {"other:CacheList": [1]}
    assert "other:CacheList layers keep nothing a radix node can restore" in plan.reason


def test_without_group_sharing_choices_prefill_on_their_own_with_no_kv_ops():
    plan = plan_prefix(["full", "other:CacheList"], True)
    s = Scheduler(max_running=4, context_length=128, eos_ids=[99], chunked_prefill_size=64,
                  kv_slots=256, prefix_cache=plan.prefix, share_groups=plan.share_groups)
    assert s.memory.tree is None
    for k in range(3):
        s.add(f"c{k}", list(range(1, 21)), m.SamplingParams(max_new_tokens=3), group="g")
    batches, finished = [], []
    while (batch := s.schedule()) is not None:
        batches.append(batch)
        rows = [r for r, smp in zip(batch.rows, batch.sample) if smp]
        out = s.on_result(m.StepResult(step=batch.step, rows=rows, tokens=[7] * len(rows)))
        finished += out.finished
    # All three admitted at once, each prefilling the whole prompt in pages of its own;
    # nothing shared or copied.
    assert batches[0].input_lens == [20, 20, 20] and len(batches[0].admit_rows) == 3
    ops = [op for b in batches for op in b.ops]
    assert {op.kind for op in ops} == {m.OpKind.PAGES} and all(op.start == 0 for op in ops)
    tables = [unpack_ids(op.slots) for op in ops]
    assert [len(t) for t in tables] == [2, 2, 2]  # 20 tokens and 3 more: two pages each
    assert len({p for t in tables for p in t}) == 6
    assert sorted((f.rid, f.reason, f.cached_tokens) for f in finished) == [
        (f"c{k}", "length", 0) for k in range(3)]
    assert s.idle and not any(s.leaks().values())
