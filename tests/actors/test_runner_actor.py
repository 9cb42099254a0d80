"""The model-runner actor in its own process on qwen3-tiny, over real sockets: the test plays
the scheduler. Its batches are real ones, built by the real scheduler core
(actors/scheduler/core.py) in the test process, configured as the scheduler actor configures
it; the runner's StepResults go back into that core, as the scheduler actor does it. Tokens are
checked against mlx-lm's own greedy generation (harness/oracle.py).

One runner process serves the module; each case starts from a fresh scheduler core (no
prefix shared across cases) and leaves every row released, so the runner holds nothing a later
case could see.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict

import msgspec
import pytest

from actors.scheduler.core import Scheduler
from actors.scheduler.prefix_plan import plan_prefix
from harness.oracle import Oracle
from models.sizing import kv_capacity, state_capacity
from protocol import messages as m
from protocol.codec import pack_ids, unpack_ids
from protocol.messages import KV_PAGE as PAGE
from tests.support.rig import READY_TIMEOUT_S, TIMEOUT_S, Kept, Rig, make_config

pytestmark = pytest.mark.slow  # starts processes, like tests/e2e

QUIET_S = 0.3  # "nothing more comes": a healthy runner answers a tiny step in milliseconds
PROMPTS = ["Hello world", "The quick brown fox jumps over the lazy dog. " * 8,
           "def f(x):\n    return", "中文的自然语言处理"]
_rids = itertools.count()


@pytest.fixture(scope="module")
def oracle(tiny_model) -> Oracle:
    return Oracle(tiny_model.path)


def start_runner(model) -> Rig:
    """The runner, its ModelLayers and its Ready kept on the rig (`layers`, `ready`)."""
    rig = Rig("runner", make_config(overlap=True), model, ("scheduler",)).start()
    rig.layers = rig.fakes["scheduler"].expect(m.ModelLayers, timeout=READY_TIMEOUT_S)
    rig.ready = rig.wait_ready()
    return rig


@pytest.fixture(scope="module")
def kept(tiny_model):
    kept = Kept(lambda: start_runner(tiny_model))
    yield kept
    kept.close()


@pytest.fixture
def runner(kept) -> "Driver":
    """The module's runner process (started again if a case stopped it), and a fresh
    scheduler core driving it."""
    rig = kept.get()
    stray = rig.fakes["scheduler"].drain()
    assert stray == [], f"left over from an earlier case: {stray}"
    driver = Driver(rig, rig.layers)
    yield driver
    # A case that left rows held (or steps unanswered) gets the next case a new process.
    rig.dirty = not driver.settle()


class Driver:
    """The fake scheduler: the real scheduler core, its batches sent to the runner, the
    runner's results fed back into it in arrival order."""

    def __init__(self, rig: Rig, layers: m.ModelLayers):
        cfg, model = rig.cfg, rig.model
        self.rig, self.sched = rig, rig.fakes["scheduler"]
        plan = plan_prefix(layers.kinds, cfg.cache.prefix)  # as the scheduler actor does
        self.core = Scheduler(max_running=cfg.scheduler.max_running_requests,
                              context_length=model.context_length, eos_ids=model.eos_ids,
                              chunked_prefill_size=cfg.scheduler.chunked_prefill_size,
                              kv_slots=kv_capacity(cfg, model),
                              state_slots=state_capacity(cfg, model),
                              prefix_cache=plan.prefix, share_groups=plan.share_groups,
                              snapshot_interval=cfg.cache.snapshot_interval,
                              max_queued=cfg.scheduler.max_queued_requests,
                              output_reserve=cfg.scheduler.output_reserve_tokens,
                              head_input=layers.head_input,
                              prefill_first=cfg.scheduler.prefill_first,
                              cached_first=cfg.scheduler.cached_first)
        self.sent: list[m.ForwardBatch] = []  # in send order
        self.results: list[m.StepResult] = []  # in arrival order
        self.in_flight_at_send: list[int] = []  # steps unanswered when each batch went
        self.tokens: dict[str, list[int]] = defaultdict(list)
        self.finished: dict[str, m.Finish] = {}

    # -- requests ----------------------------------------------------------------------------

    def add(self, prompt: list[int], max_new_tokens: int, **params) -> str:
        rid = f"r{next(_rids)}"
        sp = m.SamplingParams(max_new_tokens=max_new_tokens, **params)
        self._absorb(self.core.add(rid, prompt, sp))
        return rid

    def _absorb(self, out) -> None:
        for rid, toks in out.tokens.items():
            assert rid not in self.finished, f"tokens for {rid} after its Finish"
            self.tokens[rid] += toks
        for fin in out.finished:
            assert fin.rid not in self.finished, f"two endings for {fin.rid}"
            self.finished[fin.rid] = fin

    # -- steps -------------------------------------------------------------------------------

    def send(self, batch: m.ForwardBatch, follows: bool) -> m.ForwardBatch:
        batch = msgspec.structs.replace(batch, follows=follows)
        self.in_flight_at_send.append(len(self.sent) - len(self.results))
        self.rig.send(batch)
        self.sent.append(batch)
        return batch

    def result(self, timeout: float = TIMEOUT_S) -> m.StepResult:
        """The next StepResult, which must be for the oldest step in flight; fed to the core."""
        got = self.sched.expect(m.StepResult, timeout)
        self.results.append(got)
        oldest = self.core.futures.oldest().step
        assert got.step == oldest, f"result for step {got.step} while step {oldest} is the " \
                                   "oldest in flight"
        assert not got.error, f"step {got.step} failed: {got.error}"
        self._absorb(self.core.on_result(got))
        return got

    def _next(self, depth: int) -> m.ForwardBatch | None:
        return self.core.schedule() if len(self.core.futures) < depth else None

    def run(self, overlap: bool, timeout: float = 60.0) -> None:
        """Until every request ended and every row is released. overlap: as the scheduler
        actor runs with scheduler.overlap, two steps in flight, each marked as followed by
        another when one was built or will be once a result is in (`follows`). Else one at a
        time, each marked as followed by nothing: the runner reads it back at once."""
        depth = 2 if overlap else 1
        deadline = time.monotonic() + timeout
        while True:
            batch = self._next(depth)
            while batch is not None:  # the scheduler actor's loop (actors/scheduler/actor.py)
                following = self._next(depth)
                follows = overlap and (following is not None or len(self.core.futures) >= depth)
                self.send(batch, follows)
                batch = following
            if not self.core.futures:
                break
            assert time.monotonic() < deadline, f"not done in {timeout:g} s: {self.finished}"
            self.result()
        assert self.core.idle and not any(self.core.leaks().values()), self.core.leaks()

    def settle(self) -> bool:
        """Answer what is in flight and release what is held; True if the runner went quiet
        with nothing held."""
        try:
            for rid in list(self.core.requests):
                self._absorb(self.core.abort(rid))
            while self.core.futures:
                self.result()
            self.run(overlap=False, timeout=10.0)
        except BaseException:  # noqa: BLE001 - the next case gets a fresh runner
            return False
        return self.sched.poll(QUIET_S) is None


def encode(oracle: Oracle, text: str) -> list[int]:
    return oracle.tokenizer.encode(text)


def check_against_oracle(runner: Driver, oracle: Oracle, asked: dict[str, tuple[list[int], int]]):
    for rid, (prompt, n) in asked.items():
        fin = runner.finished[rid]
        assert fin.reason in ("length", "stop"), fin
        oracle.check(prompt, runner.tokens[rid], oracle.greedy(prompt, n))


# -- startup -----------------------------------------------------------------------------------


def test_startup_says_the_model_layers_then_ready(runner, tiny_model):
    assert runner.rig.layers == m.ModelLayers(kinds=["full", "full"], head_input=False)
    ready = runner.rig.ready
    assert ready.info["model"] == tiny_model.name and "weights" in ready.info


# -- steps -------------------------------------------------------------------------------------


def add_prompts(runner, oracle) -> dict[str, tuple[list[int], int]]:
    """Every prompt of PROMPTS as a request of its own length: rid -> (ids, max_new_tokens)."""
    asked = {}
    for k, text in enumerate(PROMPTS):
        ids = encode(oracle, text)
        asked[runner.add(ids, 6 + 3 * k)] = (ids, 6 + 3 * k)
    return asked


def test_steps_come_back_in_order_with_mlx_lm_greedy_tokens(runner, oracle):
    """One step at a time (follows=False): every result is for the step just sent, its rows
    the step's sampled rows, and each request's tokens are mlx-lm's greedy ones (the long
    prompt is prefilled in chunks of 64 beside the others' decodes)."""
    asked = add_prompts(runner, oracle)
    runner.run(overlap=False)
    assert [r.step for r in runner.results] == [b.step for b in runner.sent]
    assert max(runner.in_flight_at_send) == 0
    for batch, result in zip(runner.sent, runner.results):
        assert result.rows == [r for r, s in zip(batch.rows, batch.sample) if s]
        assert len(result.tokens) == len(result.rows)
    assert any(not f and not s for b in runner.sent for f, s in zip(b.future, b.sample)), \
        "no prompt was prefilled in chunks"
    check_against_oracle(runner, oracle, asked)


def test_overlapped_steps_give_the_tokens_of_steps_sent_one_at_a_time(tiny_model, runner,
                                                                      oracle):
    """With two steps in flight (step N+1 sent, its decode inputs the runner's futures,
    before step N's result is out) every result still comes back in step order, and each
    request gets the tokens it gets with one step at a time: mlx-lm's."""
    asked = add_prompts(runner, oracle)
    runner.run(overlap=True)
    assert [r.step for r in runner.results] == [b.step for b in runner.sent]
    assert max(runner.in_flight_at_send) == 1, "never two steps in flight"
    overlapped = [b for b, n in zip(runner.sent, runner.in_flight_at_send) if n]
    assert any(any(b.future) for b in overlapped), "no decode step sent on futures in flight"
    check_against_oracle(runner, oracle, asked)


def test_a_step_followed_by_nothing_yet_still_comes_back(runner, oracle):
    """`follows` says a next step is coming: the runner waits for it only briefly
    (FOLLOW_S) before reading the step back, so a next step that does not come in time does
    not hold the result."""
    ids = encode(oracle, PROMPTS[0])
    rid = runner.add(ids, 4)
    first = runner.send(runner.core.schedule(), follows=True)  # and nothing is sent after it
    sent = time.monotonic()
    got = runner.result()
    waited = time.monotonic() - sent
    assert got.step == first.step and len(got.tokens) == 1
    assert waited < 1.0, f"the result waited {waited:.3f} s for a step that never came"
    runner.run(overlap=True)
    check_against_oracle(runner, oracle, {rid: (ids, 4)})


def test_two_steps_sent_back_to_back_come_back_in_order_with_the_future_resolved(runner,
                                                                                  oracle):
    """Step N (a prompt, sampled; marked as followed) and step N+1 (its decode, on the token
    N samples, which only the runner has) sent back to back, N+1 within the runner's wait
    for it: N's result goes out first, and N+1 decodes from N's token."""
    ids = encode(oracle, PROMPTS[2])
    rid = runner.add(ids, 3)
    n = runner.core.schedule()
    n1 = runner.core.schedule()
    assert n1 is not None and n1.future == [True] and n1.rows == n.rows
    runner.send(n, follows=True)
    runner.send(n1, follows=False)
    first, second = runner.result(), runner.result()
    assert (first.step, second.step) == (n.step, n1.step)
    runner.run(overlap=True)
    check_against_oracle(runner, oracle, {rid: (ids, 3)})


def test_a_cached_prefix_gives_mlx_lm_tokens(runner, oracle):
    """A prompt served again starts from its cached prefix, read where the first request
    wrote it in the KV pool (its pages shared), instead of computing it, and gets the same
    tokens: mlx-lm's."""
    ids = encode(oracle, PROMPTS[1])
    before = runner.add(ids, 6)
    runner.run(overlap=True)
    after = runner.add(ids, 6)
    runner.run(overlap=True)
    assert first_chunks(runner.sent) == [0, len(ids) - 1]
    tables = [unpack_ids(op.slots) for b in runner.sent for op in b.ops
              if op.kind == m.OpKind.PAGES and op.start == 0]
    shared = (len(ids) - 1) // PAGE
    assert len(tables) == 2 and tables[1][:shared] == tables[0][:shared], tables
    check_against_oracle(runner, oracle, {before: (ids, 6), after: (ids, 6)})


def first_chunks(batches: list[m.ForwardBatch]) -> list[int]:
    """Where each admitted request's first prompt chunk starts: its cached prefix."""
    return [b.start_pos[b.rows.index(row)] for b in batches for row in b.admit_rows]


# -- failures ----------------------------------------------------------------------------------

EMPTY = dict(rows=[], input_lens=[], start_pos=[], future=[], sample=[], input_ids=b"")
BAD_BATCHES = {
    # A decode row on a future nobody sampled: the row was never admitted nor prefilled.
    "never-prefilled": (m.ForwardBatch(step=9001, rows=[3], input_lens=[1], start_pos=[5],
                                       future=[True], sample=[True], input_ids=b""),
                        "rows [3] decode but were never prefilled"),
    # An op on memory that does not exist: a page past the pool (memory.kv_tokens is 4096:
    # 256 pages and the scratch page).
    "page-past-the-pool": (m.ForwardBatch(step=9002, **EMPTY, ops=[m.Op(
        kind=m.OpKind.PAGES, dst=2, start=0, slots=pack_ids([99_999]))]),
        "KV page 99999 is past the pool's 257 pages"),
    # A state op on a model without recurrent state.
    "state-op": (m.ForwardBatch(step=9003, **EMPTY, ops=[m.Op(kind=m.OpKind.CLEAR, dst=7)]),
                 "no state pool"),
    # A prompt chunk for a row never admitted (no sampling parameters ever came for it).
    "not-admitted": (m.ForwardBatch(step=9004, rows=[1], input_lens=[3], start_pos=[0],
                                    future=[False], sample=[True],
                                    input_ids=pack_ids([1, 2, 3])),
                     "rows [1] were not admitted"),
    # A row past the request pool (max_running_requests is 4).
    "row-past-the-pool": (m.ForwardBatch(step=9005, rows=[9], input_lens=[3], start_pos=[0],
                                         future=[False], sample=[True],
                                         input_ids=pack_ids([1, 2, 3]), admit_rows=[9],
                                         admit_params=[m.SamplingParams(max_new_tokens=2)]),
                          "index 9"),
}


@pytest.mark.parametrize("case", list(BAD_BATCHES))
def test_a_bad_batch_fails_its_step_naming_why_and_the_runner_serves_on(runner, oracle, case):
    batch, why = BAD_BATCHES[case]
    runner.rig.send(batch)
    got = runner.sched.expect(m.StepResult)
    assert (got.step, got.rows, got.tokens) == (batch.step, [], [])
    assert why in got.error, got.error
    # The runner dropped what it held and serves the next batch from scratch.
    ids = encode(oracle, PROMPTS[3])
    rid = runner.add(ids, 5)
    runner.run(overlap=True)
    check_against_oracle(runner, oracle, {rid: (ids, 5)})


@pytest.mark.parametrize("batch", [
    m.ForwardBatch(step=9101, rows=[1], input_lens=[5], start_pos=[0], future=[False],
                   sample=[True], input_ids=pack_ids([1, 2, 3]), admit_rows=[1],
                   admit_params=[m.SamplingParams(max_new_tokens=2)]),
    m.ForwardBatch(step=9102, rows=[1, 2], input_lens=[3], start_pos=[0], future=[False],
                   sample=[True], input_ids=pack_ids([1, 2, 3]), admit_rows=[1],
                   admit_params=[m.SamplingParams(max_new_tokens=2)]),
], ids=["ids-short-of-input_lens", "columns-of-unequal-length"])
def test_an_inconsistent_batch_fails_its_step(runner, batch):
    runner.rig.send(batch)
    got = runner.sched.expect(m.StepResult)
    # Whatever the outcome, row 1 is released before the case ends.
    runner.rig.send(m.ForwardBatch(step=9199, **EMPTY, release_rows=[1, 2]))
    assert runner.sched.expect(m.StepResult).step == 9199
    assert got.step == batch.step and got.error, f"served: {got}"


def test_after_a_failed_step_a_prefix_cached_before_it_is_computed_again(runner, oracle):
    """A step that fails on the runner (here: a row whose grammar does not build) ends its
    requests with an error, and the runner rebuilds its memory empty. A prompt served before
    the failure was in the scheduler's prefix cache, which forgets it then (Memory.forget):
    served again, it is computed again (no prefix read from pages the runner no longer holds) and
    gets mlx-lm's tokens, not tokens sampled from zeroed KV."""
    ids = encode(oracle, PROMPTS[1])
    before = runner.add(ids, 6)
    runner.run(overlap=True)
    bad = runner.add(encode(oracle, "broken grammar"), 4, constraint_kind="json_schema",
                     constraint="{not a grammar")
    step = runner.send(runner.core.schedule(), follows=False)
    got = runner.sched.expect(m.StepResult)
    assert got.step == step.step and got.error, got
    runner.results.append(got)
    runner._absorb(runner.core.on_result(got))
    assert runner.finished[bad].reason == "error"
    runner.run(overlap=True)
    sent = len(runner.sent)
    after = runner.add(ids, 6)
    runner.run(overlap=True)
    assert first_chunks(runner.sent[sent:]) == [0], "a prefix cached before the failure was read"
    check_against_oracle(runner, oracle, {before: (ids, 6), after: (ids, 6)})


# -- shutdown ----------------------------------------------------------------------------------


def test_shutdown_exits_0_and_removes_the_inbox(runner, oracle):
    ids = encode(oracle, PROMPTS[0])
    runner.add(ids, 50)
    runner.send(runner.core.schedule(), follows=True)  # a step in flight
    assert runner.rig.shutdown(timeout=10.0) == 0
    assert not runner.rig.inbox_file().exists()
