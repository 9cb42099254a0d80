"""The one KV pool under any mix of traffic (docs/architecture.md, section 8): hypothesis drives
the real scheduler core against the real runner core (tests/support/driver.py, no sockets) on
the dense and the hybrid built-in model, through arrivals at random steps of prompts that share
random prefixes (whole-page and partial-page hits), small prefill chunks, aborts, retractions
under a budget of a few pages, one or two steps in flight, the prefix cache on, the runner's
arrays opened at the budget or below it (then they double as page ids arrive).

After every build and every landing: the runner's pool holds no more than the budget's pages
and the scratch page, every page id it is sent is inside them and held by the scheduler, its
page tables are the scheduler's, and every KV slot the scheduler holds has exactly one owner (a
live request or the tree). At the end every page is free once the tree lets go, and every
request's tokens are mlx-lm's greedy ones (a prefix of them where it was aborted or cut short
by memory)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, event, given, settings, strategies as st

from actors.model_runner import kv_pages
from actors.model_runner.kv_pages import FIRST_PAGES
from actors.model_runner.loading import load_model
from actors.model_runner.runner import ModelRunner
from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from harness.oracle import Oracle
from models.builtin import ensure_builtin
from models.info import ModelInfo, read_model_info
from protocol import messages as m
from protocol.codec import unpack_ids
from protocol.messages import KV_PAGE as PAGE
from tests.support.driver import Driver

# Texts whose first tokens are the shared prefixes; requests keep a random part of one and add
# a few tokens of their own (SUFFIX, from an offset that differs per request).
BASES = ["The quick brown fox jumps over the lazy dog, and then it runs into the forest "
         "where the trees are tall and the rivers are cold and clear all year long. Birds sing "
         "in the branches, deer drink at the water, and the fox sleeps under an old oak tree.",
         "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + "
         "fibonacci(n - 2)\n\nfor i in range(10):\n    print(i, fibonacci(i))\n",
         "中文的自然语言处理很有趣，我们今天来讨论一下分词、词性标注和句法分析这些基本任务的方法。"
         "首先介绍分词的基本思路，然后比较几种常见的词性标注模型，最后讨论句法分析的评价标准。"]
SUFFIX = "Q: What is 2 + 2? A: four. Q: And 3 + 3? A: six. Q: And 4 + 4? A: eight."
KEEP = 40  # the longest shared prefix taken, in tokens: up to two whole pages and a partial one
MAX_NEW = 16


class Setup:
    """A built-in model, loaded once for every runner built on it, its oracle, and the token
    ids prompts are made of."""

    def __init__(self, name: str, model: Any, oracle: Oracle, info: ModelInfo,
                 bases: list[list[int]], suffix: list[int]):
        self.name, self.model, self.oracle, self.info = name, model, oracle, info
        self.bases, self.suffix = bases, suffix

    def __repr__(self) -> str:  # as hypothesis names it in a failing example
        return self.name


@pytest.fixture(scope="module", params=["qwen3-tiny", "qwen3_5-tiny"])
def setup(request, model_cache) -> Setup:
    path = str(ensure_builtin(request.param, cache_dir=model_cache, progress=False))
    oracle = Oracle(path)
    bases = [oracle.tokenizer.encode(text)[:KEEP] for text in BASES]
    suffix = oracle.tokenizer.encode(SUFFIX)
    assert all(len(b) == KEEP for b in bases) and len(suffix) >= 24
    return Setup(request.param, load_model(path), oracle, read_model_info(path), bases, suffix)


class Watched:
    """The real runner; before it runs a step, the page ids the step's ops name are checked
    against the budget and against what the scheduler holds."""

    def __init__(self, runner: ModelRunner, sched: Scheduler, limit: int):
        self.runner, self.sched, self.limit = runner, sched, limit
        self.sent = {m.OpKind.PAGES: 0, m.OpKind.KV_COPY: 0}
        self.shared = 0  # pages of the tree a row's table was given at admission

    def step(self, batch: m.ForwardBatch) -> m.StepResult:
        held = self.sched.kv.owned
        for op in batch.ops:
            if op.kind is m.OpKind.PAGES:
                pages = unpack_ids(op.slots)
                assert all(0 < p < self.limit for p in pages), \
                    f"pages {pages} outside 1..{self.limit - 1}"
                assert set(pages) <= {s // PAGE for s in held}, \
                    f"row {op.dst} sent pages {pages} the scheduler does not hold"
                if op.start == 0:
                    tree = self.sched.memory.tree
                    self.shared += len({s // PAGE for n in tree.walk() for s in n.slots}
                                       .intersection(pages))
            elif op.kind is m.OpKind.KV_COPY:
                ids = unpack_ids(op.slots)
                assert all(PAGE <= s < self.limit * PAGE for s in ids), f"KV copy of {ids}"
                assert set(ids) <= held, "a KV copy from or into a slot nobody holds"
            if op.kind in self.sent:
                self.sent[op.kind] += 1
        return self.runner.step(batch)


def checker(runner: ModelRunner, limit: int, per_page: int):
    """What holds after every build and landing (Driver's `check`)."""
    kv = runner.pools.kv

    def check(sched: Scheduler) -> None:
        assert kv.pages <= limit and all(a.shape[1] <= limit for a in kv.arrays()), \
            f"the runner holds {kv.pages} pages; the budget is {limit} with the scratch page"
        assert kv.nbytes <= limit * per_page
        live = list(sched.requests.values())
        held = [s for r in live for s in r.held]
        cached = [s for node in sched.memory.tree.walk() for s in node.slots]
        assert len(held) + len(cached) == len(set(held) | set(cached)), "a KV slot owned twice"
        assert set(held) | set(cached) == sched.kv.owned, "a KV slot held by no owner"
        for r in live:
            if r.row:  # its table is the runner's, and every position it wrote is still held
                assert runner.rows.pages.get(r.row) == r.pages, f"row {r.row}'s page table"
                assert set(r.slots(0, r.kv_len)) <= sched.kv.owned
    return check


def play(setup: Setup, ops, rows, depth, chunk, pages, reserve, interval, first=FIRST_PAGES):
    """Runs `ops` (arrive / abort / tick) and then every request to its end, checking after
    every step; returns (scheduler, driver, watched runner). first: the runner's arrays'
    first size in pages: below the budget's, they grow to it as page ids arrive."""
    info, bases, suffix = setup.info, setup.bases, setup.suffix
    kv_slots = pages * PAGE
    states = 4 * rows if info.state_layers else 0
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kv_pages, "FIRST_PAGES", first)
        runner = ModelRunner(setup.model, rows, kv_slots=kv_slots, state_slots=states)
    plan = plan_prefix(runner.layers.kinds, True)
    assert plan.prefix
    sched = Scheduler(max_running=rows, chunked_prefill_size=chunk, kv_slots=kv_slots,
                      context_length=info.context_length, eos_ids=info.eos_ids,
                      output_reserve=reserve, prefix_cache=True, share_groups=plan.share_groups,
                      state_slots=states, snapshot_interval=interval,
                      head_input=runner.head_input)
    limit = kv_slots // PAGE + 1
    kv = runner.pools.kv
    assert kv.limit == limit
    per_page = sum(a.nbytes // a.shape[1] for a in kv.arrays())
    watched = Watched(runner, sched, limit)
    d = Driver(sched, watched, depth, check=checker(runner, limit, per_page))
    prompts: dict[str, list[int]] = {}
    max_new: dict[str, int] = {}
    for op in ops:
        if op[0] == "arrive":
            _, base, keep, extra, n = op
            rid = f"r{len(prompts)}"
            at = 3 * len(prompts) % (len(suffix) - extra + 1)
            prompts[rid] = bases[base][:keep] + suffix[at:at + extra]
            max_new[rid] = n
            d.add(rid, prompts[rid], m.SamplingParams(max_new_tokens=n))
        elif op[0] == "abort" and prompts:
            d.abort(f"r{op[1] % len(prompts)}")
        elif op[0] == "tick":
            d.step(late=op[1])
    d.run(limit=600)  # ample: six requests of at most 62 positions each

    assert sched.idle and not any(sched.leaks().values()), sched.leaks()
    tree = sched.memory.tree
    tree.check()
    assert sched.kv.pages_free + tree.cached_pages == sched.kv.pages_total, \
        "idle, a page is neither free nor holding a slot of the tree"
    tree.evict(tree.cached_tokens)
    assert tree.cached_tokens == 0 and not sched.kv.owned, "a slot held after the tree let go"
    assert sched.kv.pages_free == sched.kv.pages_total == pages, "a page not free at the end"
    if sched.memory.states is not None:
        tree.evict_states(sched.memory.states.capacity)
        assert sched.memory.states.available == sched.memory.states.capacity
    assert set(d.finished) == set(prompts), "every request gets exactly one terminal reply"
    for rid, fin in d.finished.items():
        got = d.tokens.get(rid, [])
        ref = setup.oracle.greedy(prompts[rid], max_new[rid])
        assert fin.reason in ("stop", "length", "abort"), (rid, fin)
        if fin.reason != "abort":
            assert (fin.reason == "stop") == (got[-1:] != [] and got[-1] in info.eos_ids)
        if fin.reason == "abort" or (fin.reason == "length" and len(got) < len(ref)):
            # Aborted, or alone and out of pages (the tree's pages its prefix was copied
            # from stay locked with it): what it got is where mlx-lm went.
            ref = ref[:len(got)]
        setup.oracle.check(prompts[rid], got, ref)
    return sched, d, watched


@st.composite
def mixes(draw) -> list[tuple]:
    """Three to six requests arriving over the first steps (a prefix of one of the BASES, a few
    tokens of their own, up to MAX_NEW tokens out), up to two aborts at random steps, and per
    step whether a result lands before the next build (late) or after it."""
    ticks = 10
    arrivals = draw(st.lists(st.tuples(
        st.integers(0, ticks // 2), st.integers(0, len(BASES) - 1), st.integers(1, KEEP),
        st.integers(0, 6), st.integers(2, MAX_NEW)), min_size=3, max_size=6))
    aborts = draw(st.lists(st.tuples(st.integers(1, ticks), st.integers(0, 5)), max_size=2))
    late = draw(st.lists(st.booleans(), min_size=ticks + 1, max_size=ticks + 1))
    ops: list[tuple] = []
    for tick in range(ticks + 1):
        ops += [("arrive", *a[1:]) for a in sorted(arrivals) if a[0] == tick]
        ops += [("abort", i) for t, i in aborts if t == tick]
        ops.append(("tick", late[tick]))
    return ops


# No shrinking: hypothesis keeps every failing example's exception while it shrinks, and with
# it the example's runner (~10 MB); a real runner's few hundred shrink steps held gigabytes. The
# mixes are small as drawn.
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow],
          phases=[Phase.explicit, Phase.reuse, Phase.generate])
@given(ops=mixes(), rows=st.integers(2, 3), depth=st.integers(1, 2),
       chunk=st.sampled_from([8, 16]), pages=st.integers(4, 6), reserve=st.integers(0, 2),
       interval=st.sampled_from([0, 16]), first=st.sampled_from([1, 2, FIRST_PAGES]))
def test_any_mix_keeps_the_pool_in_its_budget_and_the_tokens_mlx_lms(
        setup, ops, rows, depth, chunk, pages, reserve, interval, first):
    sched, d, watched = play(setup, ops, rows, depth, chunk, pages, reserve, interval, first)
    event(f"retractions: {min(sched.retractions, 2)}")
    event(f"prefix hits: {min(sched.memory.hits, 2)}")
    event(f"whole pages shared: {min(watched.shared, 2)}")
    event(f"partial-page copies: {min(watched.sent[m.OpKind.KV_COPY], 2)}")
    event(f"the arrays grew: {watched.runner.pools.kv.pages > min(first, pages + 1)}")
    event(f"reasons: {sorted({f.reason for f in d.finished.values()})}")


def test_the_mix_reaches_every_path(setup):
    """One fixed mix that takes each path the property test draws from: a whole-page hit and
    a partial-page copy, an abort of a running request, a retraction when decode runs out of
    pages, two steps in flight, the runner's arrays growing from two pages to the budget's."""
    # r0 leaves 40 tokens of base 0 in the tree (two whole pages and half of a third, its
    # state snapshotted there on the hybrid model); r1 extends them: it shares the two pages
    # and copies the half page into one of its own, which it decodes into. r2 and r3 fill a
    # page each: six pages held, and their first decode tokens need two more, which no
    # eviction frees (r1's lock keeps the tree's half page), so one of them is retracted.
    # r1 is aborted while it decodes.
    ops = [("arrive", 0, 40, 0, 1)] + [("tick", False)] * 5 + [
        ("arrive", 0, 40, 2, 8), ("arrive", 1, 14, 2, 8), ("arrive", 2, 14, 2, 8),
        ("tick", False), ("tick", True), ("tick", False), ("tick", True), ("tick", False),
        ("abort", 1), ("tick", True)]
    sched, d, watched = play(setup, ops, rows=3, depth=2, chunk=16, pages=6, reserve=0,
                             interval=0, first=2)
    assert sched.memory.hits and sched.memory.hit_tokens >= 2 * PAGE
    assert watched.shared >= 2, "the tree's whole pages were not shared"
    assert watched.sent[m.OpKind.KV_COPY], "no partial page was copied"
    assert sched.retractions > 0, "the budget was meant to force a retraction"
    assert watched.runner.pools.kv.pages == 6 + 1, "the arrays did not grow to the budget"
    assert d.finished["r1"].reason == "abort" and d.tokens.get("r1"), "r1 was not running"
    assert {d.finished[rid].reason for rid in ("r0", "r2", "r3")} <= {"stop", "length"}
