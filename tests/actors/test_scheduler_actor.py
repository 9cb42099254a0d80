"""The scheduler actor in its own process, over real sockets, against a fake runner, a fake
tokenizer and a fake detokenizer played by the test.

The fake runner says ModelLayers first (the scheduler waits for it before Ready), then answers
each ForwardBatch with a StepResult: one deterministic token per sampled row, remembered per row,
so the tokens reaching the fake detokenizer can be checked against what the runner "sampled".
One scheduler process serves every case of a mode (overlap on, overlap off); each case uses
prompts with a unique first token (no prefix-cache hit across cases) and leaves it idle.
"""

from __future__ import annotations

import itertools
import time
from collections import defaultdict
from typing import Callable

import pytest
import zmq

from protocol import messages as m
from protocol.codec import pack_ids, unpack_ids
from tests.support.rig import TIMEOUT_S, Kept, Rig, make_config

pytestmark = pytest.mark.slow  # starts processes, like tests/e2e

NEIGHBOURS = ("runner", "detokenizer")  # the fake tokenizer only pushes into the inbox
LAYERS = m.ModelLayers(kinds=["full", "full"])  # qwen3-tiny: two full-attention layers
STOP = 777
QUIET_S = 0.3  # "nothing more comes": a healthy scheduler answers in milliseconds

_first_tokens = itertools.count(3000)


def make_prompt(n: int) -> list[int]:
    first = next(_first_tokens)  # unique per prompt: no case hits another's cached prefix
    return [first] + [100 + (first * 7 + 13 * i) % 20000 for i in range(1, n)]


def start_scheduler(model, overlap: bool = True) -> Rig:
    return Rig("scheduler", make_config(overlap=overlap), model, NEIGHBOURS).start()


class Steps:
    """The fake runner and the fake detokenizer, driven from one loop.

    Answers every ForwardBatch in arrival order (as the runner does) unless told to hold, with
    `token(row, n)` for a row's n-th sample since its admission; records the batches, the tokens
    given per row, and what the detokenizer receives per rid.
    """

    def __init__(self, rig: Rig, overlap: bool = True):
        self.rig, self.overlap = rig, overlap
        self.runner, self.detok = rig.fakes["runner"], rig.fakes["detokenizer"]
        self.batches: list[m.ForwardBatch] = []
        self.unanswered: list[m.ForwardBatch] = []  # held back by the case, in step order
        self.given: dict[int, list[int]] = defaultdict(list)  # row -> tokens since admission
        self.prompts: dict[str, list[int]] = {}
        self.tokens: dict[str, list[int]] = defaultdict(list)  # rid -> tokens at the detokenizer
        self.finished: dict[str, m.Finish] = {}
        self.token_batches: list[m.TokenBatch] = []
        self.token: Callable[[int, int], int] = lambda row, n: 1000 + 37 * row + n
        self.fail_when: Callable[[m.ForwardBatch], str] = lambda batch: ""

    # -- the fake tokenizer ----------------------------------------------------------------

    def submit(self, rid: str, prompt_len: int = 10, max_new_tokens: int = 4,
               **params) -> m.SamplingParams:
        prompt = self.prompts[rid] = make_prompt(prompt_len)
        sp = m.SamplingParams(max_new_tokens=max_new_tokens, **params)
        self.rig.send(m.TokenizedRequest(rid=rid, input_ids=pack_ids(prompt), params=sp))
        return sp

    # -- the fake runner -------------------------------------------------------------------

    def next_batch(self, timeout: float = TIMEOUT_S) -> m.ForwardBatch:
        return self._record(self.runner.expect(m.ForwardBatch, timeout))

    def answer(self, batch: m.ForwardBatch, error: str = "") -> list[int]:
        rows = [r for r, s in zip(batch.rows, batch.sample) if s]
        tokens = []
        if not error:
            for row in rows:
                tokens.append(self.token(row, len(self.given[row])))
                self.given[row].append(tokens[-1])
        self.rig.send(m.StepResult(step=batch.step, rows=rows, tokens=tokens, error=error))
        self.unanswered.remove(batch)
        return tokens

    def _record(self, batch: m.ForwardBatch) -> m.ForwardBatch:
        for row in batch.admit_rows:
            self.given[row] = []
        self.batches.append(batch)
        self.unanswered.append(batch)
        return batch

    # -- the fake detokenizer --------------------------------------------------------------

    def _output(self, tb: m.TokenBatch) -> None:
        self.token_batches.append(tb)
        ids, at = unpack_ids(tb.token_ids), 0
        assert len(ids) == sum(tb.counts) and len(tb.rids) == len(tb.counts)
        for rid, n in zip(tb.rids, tb.counts):
            assert rid not in self.finished, f"tokens for {rid} after its Finish"
            self.tokens[rid] += ids[at:at + n]
            at += n
        for fin in tb.finished:
            assert fin.rid not in self.finished, f"two terminal replies for {fin.rid}"
            self.finished[fin.rid] = fin

    def run(self, until: Callable[[], bool], timeout: float = 10.0) -> None:
        """Answer batches and collect outputs until `until()` holds."""
        poller = zmq.Poller()
        poller.register(self.runner.sock, zmq.POLLIN)
        poller.register(self.detok.sock, zmq.POLLIN)
        deadline = time.monotonic() + timeout
        while not until():
            if time.monotonic() > deadline:
                pytest.fail(f"condition not reached in {timeout:g} s; finished="
                            f"{self.finished}, tokens={dict(self.tokens)}, "
                            f"last steps={[b.step for b in self.batches[-3:]]}")
            self.rig.actor.check_alive("steps and outputs")
            for sock, _ in poller.poll(50):
                if sock is self.runner.sock:
                    batch = self._record(self.runner.dec.decode(sock.recv()))
                    self.answer(batch, error=self.fail_when(batch))
                else:
                    msg = self.detok.dec.decode(sock.recv())
                    assert isinstance(msg, m.TokenBatch), msg
                    self._output(msg)

    def finish(self, *rids: str, timeout: float = 10.0) -> None:
        self.run(lambda: all(r in self.finished for r in rids), timeout)

    def collect_output(self, timeout: float = TIMEOUT_S) -> m.TokenBatch:
        tb = self.detok.expect(m.TokenBatch, timeout)
        self._output(tb)
        return tb

    def released(self, row: int) -> bool:
        return any(row in b.release_rows for b in self.batches)

    # -- reading the record ----------------------------------------------------------------

    def row_of(self, rid: str) -> int:
        """The row whose first prefill chunk carried this rid's prompt."""
        prompt = self.prompts[rid]
        for b in self.batches:
            ids, at = unpack_ids(b.input_ids), 0
            for row, n, start, fut in zip(b.rows, b.input_lens, b.start_pos, b.future):
                if fut:
                    continue
                if start == 0 and ids[at:at + n] == prompt[:n] and row in b.admit_rows:
                    return row
                at += n
        raise AssertionError(f"{rid} was never admitted; batches: {self.batches}")

    def carrying(self, row: int, after: int = 0) -> list[m.ForwardBatch]:
        return [b for b in self.batches if row in b.rows and b.step > after]

    def settle(self) -> bool:
        """Answer what a case held back and what is still coming, until the scheduler goes
        quiet; True if it did."""
        for batch in list(self.unanswered):
            self.answer(batch)
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            batch = self.runner.poll(QUIET_S)
            if batch is None:
                self.detok.drain()
                return True
            self.answer(self._record(batch))
        return False


@pytest.fixture(scope="module", params=[True, False], ids=["overlap", "serial"])
def kept(request, tiny_model):
    """One scheduler per mode for the whole module; replaced if a case leaves it unusable."""

    def start() -> Rig:
        rig = start_scheduler(tiny_model, request.param)
        rig.send(LAYERS)
        rig.wait_ready()
        rig.overlap = request.param
        return rig

    kept = Kept(start)
    yield kept
    kept.close()


@pytest.fixture
def steps(kept):
    rig = kept.get()
    rig.fakes["detokenizer"].drain()
    s = Steps(rig, rig.overlap)
    yield s
    rig.dirty = not s.settle()


def test_admitted_request_prefills_then_decodes_from_futures(steps):
    """Admission brings the prompt and the sampling parameters once; every decode row after
    that is a future: no input token on the wire, one position further each step."""
    params = steps.submit("adm", prompt_len=10, max_new_tokens=4)
    steps.finish("adm")
    row = steps.row_of("adm")
    first, *decodes = steps.carrying(row)
    assert (first.rows, first.input_lens, first.start_pos) == ([row], [10], [0])
    assert (first.future, first.sample) == ([False], [True])
    assert unpack_ids(first.input_ids) == steps.prompts["adm"]
    assert (first.admit_rows, first.admit_params) == ([row], [params])
    assert len(decodes) == 3  # the prefill samples token 1, three decode steps the rest
    for k, b in enumerate(decodes):
        assert (b.rows, b.input_lens, b.start_pos) == ([row], [1], [10 + k])
        assert (b.future, b.sample) == ([True], [True])
        assert b.input_ids == b"" and b.admit_rows == [] and b.admit_params == []


def test_a_new_prompt_joins_running_decodes_and_only_its_ids_travel(steps):
    steps.submit("old", prompt_len=6, max_new_tokens=30)
    steps.run(lambda: len(steps.tokens["old"]) >= 2)
    steps.submit("new", prompt_len=20, max_new_tokens=3)
    steps.finish("old", "new")
    old, new = steps.row_of("old"), steps.row_of("new")
    assert old != new
    joined = next(b for b in steps.batches if new in b.admit_rows)
    assert old in joined.rows, "the new prompt did not share a step with the running request"
    i, j = joined.rows.index(old), joined.rows.index(new)
    assert (joined.future[i], joined.input_lens[i]) == (True, 1)
    assert (joined.future[j], joined.input_lens[j], joined.start_pos[j]) == (False, 20, 0)
    assert unpack_ids(joined.input_ids) == steps.prompts["new"]  # nothing of the decode row
    assert steps.tokens["old"] == steps.given[old][:30]
    assert steps.tokens["new"] == steps.given[new][:3]


def test_a_long_prompt_is_prefilled_in_chunks(steps):
    steps.submit("long", prompt_len=150, max_new_tokens=2)  # chunked_prefill_size = 64
    steps.finish("long")
    row = steps.row_of("long")
    chunks = [b for b in steps.carrying(row) if not b.future[b.rows.index(row)]]
    got = [(b.start_pos[b.rows.index(row)], b.input_lens[b.rows.index(row)],
            b.sample[b.rows.index(row)]) for b in chunks]
    assert got == [(0, 64, False), (64, 64, False), (128, 22, True)]
    assert [t for b in chunks for t in unpack_ids(b.input_ids)] == steps.prompts["long"]
    assert steps.finished["long"].completion_tokens == 2


def test_steps_in_flight_follow_the_overlap_setting(steps):
    """Overlap: step N+1 is sent before step N's result exists (two in flight, never three).
    Serial: the next step waits for the result."""
    depth = 2 if steps.overlap else 1
    steps.submit("ovl", prompt_len=8, max_new_tokens=8)
    held = [steps.next_batch() for _ in range(depth)]
    assert [b.step for b in held] == list(range(held[0].step, held[0].step + depth))
    if steps.overlap:
        row = held[0].rows[0]
        assert (held[1].rows, held[1].future, held[1].start_pos) == ([row], [True], [8])
    assert steps.runner.poll(QUIET_S) is None, f"more than {depth} steps in flight"
    steps.answer(held[0])
    after = steps.next_batch()
    assert after.step == held[-1].step + 1
    for batch in (*held[1:], after):  # results go back in step order
        steps.answer(batch)
    steps.finish("ovl")
    assert steps.tokens["ovl"] == steps.given[steps.row_of("ovl")][:8]


def test_tokens_stream_and_the_request_ends_at_max_new_tokens(steps):
    steps.submit("len", prompt_len=5, max_new_tokens=5)
    steps.finish("len")
    row = steps.row_of("len")
    assert steps.tokens["len"] == steps.given[row][:5]
    assert steps.finished["len"] == m.Finish(rid="len", reason="length", prompt_tokens=5,
                                             completion_tokens=5)
    mentions = [tb for tb in steps.token_batches if "len" in tb.rids]
    assert sum(tb.counts[tb.rids.index("len")] for tb in mentions) == 5
    steps.run(lambda: steps.released(row))  # the row comes back once nothing references it


@pytest.mark.parametrize("how", ["stop_token_ids", "eos"])
def test_a_stop_token_ends_the_request_with_reason_stop(steps, tiny_model, how):
    stop = STOP if how == "stop_token_ids" else tiny_model.eos_ids[0]
    params = {"stop_token_ids": [STOP]} if how == "stop_token_ids" else {}
    steps.token = lambda row, n: stop if n == 2 else 2000 + n
    steps.submit("stop", prompt_len=7, max_new_tokens=50, **params)
    steps.finish("stop")
    assert steps.tokens["stop"] == [2000, 2001, stop]  # nothing sampled after it is sent on
    assert steps.finished["stop"] == m.Finish(rid="stop", reason="stop", prompt_tokens=7,
                                              completion_tokens=3)


def test_a_step_in_flight_past_the_finish_is_dropped_and_then_frees_the_row(steps):
    """docs/architecture.md, section 5: a request that finishes at step N may already sit in step N+1; its output there
    is dropped, and its row is released only after N+1 returns."""
    if not steps.overlap:
        pytest.skip("needs a second step in flight")
    steps.token = lambda row, n: STOP if n == 1 else 2000 + n
    steps.submit("late", prompt_len=4, max_new_tokens=50, stop_token_ids=[STOP])
    b1, b2 = steps.next_batch(), steps.next_batch()
    steps.answer(b1)
    b3 = steps.next_batch()  # carries the request while b2 (which samples STOP) is out
    row = b1.rows[0]
    assert b3.rows == [row]
    steps.answer(b2)
    while "late" not in steps.finished:
        steps.collect_output()
    assert steps.finished["late"] == m.Finish(rid="late", reason="stop", prompt_tokens=4,
                                              completion_tokens=2)
    assert steps.runner.poll(QUIET_S) is None, "row released while a step in flight holds it"
    steps.answer(b3)
    release = steps.next_batch()
    assert (release.rows, release.release_rows) == ([], [row])
    assert steps.tokens["late"] == [2000, STOP]  # b3's token never reaches the detokenizer
    assert steps.detok.poll(QUIET_S) is None


def test_abort_mid_run_ends_with_reason_abort_and_releases_the_row(steps):
    steps.submit("abrt", prompt_len=6, max_new_tokens=200)
    steps.run(lambda: len(steps.tokens["abrt"]) >= 3)
    steps.rig.send(m.Abort(rid="abrt"))
    steps.finish("abrt")
    fin = steps.finished["abrt"]
    assert (fin.reason, fin.prompt_tokens) == ("abort", 6)
    assert fin.completion_tokens == len(steps.tokens["abrt"]) < 200
    row = steps.row_of("abrt")
    steps.run(lambda: steps.released(row))
    release = next(b for b in steps.batches if row in b.release_rows)
    assert steps.carrying(row, after=release.step) == []  # nothing runs on it afterwards


def test_a_failed_step_ends_the_requests_it_carried_with_reason_error(steps):
    steps.submit("errA", prompt_len=5, max_new_tokens=100)
    steps.submit("errB", prompt_len=9, max_new_tokens=100)
    steps.run(lambda: len(steps.tokens["errA"]) >= 2 and len(steps.tokens["errB"]) >= 2)
    a, b = steps.row_of("errA"), steps.row_of("errB")
    failed: list[m.ForwardBatch] = []

    def fail(batch: m.ForwardBatch) -> str:
        if not failed and {a, b} <= set(batch.rows):
            failed.append(batch)
            return "boom: device lost"
        return ""

    steps.fail_when = fail
    steps.finish("errA", "errB")
    for rid in ("errA", "errB"):
        fin = steps.finished[rid]
        assert (fin.reason, fin.code) == ("error", 500)
        assert "boom: device lost" in fin.message
        assert fin.completion_tokens == len(steps.tokens[rid]) < 100
    steps.run(lambda: steps.released(a) and steps.released(b))


@pytest.mark.parametrize("when", ["after_ready", "before_layers"])
def test_shutdown_exits_0_and_removes_the_inbox(tiny_model, when):
    with start_scheduler(tiny_model) as rig:
        if when == "after_ready":
            rig.send(LAYERS)
            rig.wait_ready()
            Steps(rig).submit("open", max_new_tokens=100)
            rig.fakes["runner"].expect(m.ForwardBatch)  # a request is running
        assert rig.shutdown(timeout=10.0) == 0
        assert not rig.inbox_file().exists()
        if when == "before_layers":
            assert rig.launcher.poll(0) is None  # no Ready without the runner's layers


def test_a_result_for_no_step_in_flight_takes_the_actor_down_loudly(tiny_model):
    with start_scheduler(tiny_model) as rig:
        rig.send(LAYERS)
        rig.wait_ready()
        rig.send(m.StepResult(step=41, rows=[1], tokens=[5]))
        failed = rig.launcher.recv(what="ActorFailed")
        assert isinstance(failed, m.ActorFailed) and failed.actor == "scheduler"
        assert rig.actor.join(10.0) == 1
