"""The scheduler core driven by scripted step results (tests/support/driver.py): no model, no
sockets."""

from protocol import messages as m
from protocol.codec import unpack_ids
from actors.scheduler.core import Scheduler
from tests.support.driver import Driver, Scripted

EOS = 99


def make_scheduler(max_running=4, context_length=64, chunk=64, kv_slots=4096, eos_ids=(EOS,),
                   **kw):
    return Scheduler(max_running=max_running, chunked_prefill_size=chunk, kv_slots=kv_slots,
                     context_length=context_length, eos_ids=list(eos_ids), **kw)


def params(n=5, **kw):
    return m.SamplingParams(max_new_tokens=n, **kw)


def test_requests_run_to_length_and_free_everything():
    s = make_scheduler()
    d = Driver(s)
    for i in range(3):
        d.collect(s.add(f"r{i}", [1, 2, 3], params(4)))
    d.run()
    assert {rid: f.reason for rid, f in d.finished.items()} == {f"r{i}": "length" for i in range(3)}
    assert all(len(d.tokens[f"r{i}"]) == 4 for i in range(3))
    assert s.idle and s.leaks() == {"rows": [], "slots": [], "requests": []}
    assert s.rows.available == 4


def test_eos_and_stop_token_ids_stop_with_reason_stop():
    s = make_scheduler()
    d = Driver(s, Scripted(s, {"a": [5, 6, EOS, 7], "b": [5, 42, 8], "c": [EOS]}))
    d.collect(s.add("a", [1], params(10)))
    d.collect(s.add("b", [1], params(10, stop_token_ids=[42])))
    d.collect(s.add("c", [1], params(10, ignore_eos=True)))
    d.run()
    assert d.tokens["a"] == [5, 6, EOS] and d.finished["a"].reason == "stop"
    assert d.tokens["b"] == [5, 42] and d.finished["b"].reason == "stop"
    assert d.finished["c"].reason == "length" and len(d.tokens["c"]) == 10


def test_every_eos_id_of_the_model_stops():
    """Models with several EOS ids (Llama 3's <|end_of_text|>, <|eom_id|>, <|eot_id|>)."""
    s = make_scheduler(eos_ids=[EOS, 98])
    d = Driver(s, Scripted(s, {"a": [5, 98, 7], "b": [5, 6, EOS]}))
    d.collect(s.add("a", [1], params(10)))
    d.collect(s.add("b", [1], params(10)))
    d.run()
    assert d.tokens == {"a": [5, 98], "b": [5, 6, EOS]}
    assert {f.reason for f in d.finished.values()} == {"stop"}


def test_first_step_prefills_then_decode_rows_are_futures():
    s = make_scheduler()
    d = Driver(s)
    d.collect(s.add("a", [1, 2, 3], params(3)))
    first = d.step()
    assert first.future == [False] and first.input_lens == [3] and first.start_pos == [0]
    assert first.admit_rows == first.rows
    second = d.step()
    assert second.future == [True] and second.start_pos == [3] and second.input_ids == b""
    assert second.admit_rows == []


def test_new_requests_join_a_running_batch_and_finished_ones_leave():
    s = make_scheduler()
    d = Driver(s)
    d.collect(s.add("a", [1, 2], params(6)))
    d.step(); d.step()
    d.collect(s.add("b", [3, 4, 5], params(2)))
    mixed = d.step()
    assert mixed.future == [True, False]  # a decodes while b prefills, in one step
    d.run()
    rows_per_step = [len(b.rows) for b in d.batches if b.rows]
    assert max(rows_per_step) == 2 and rows_per_step[-1] == 1
    # The runner is told to drop what it holds for every freed row.
    released = [r for b in d.batches for r in b.release_rows]
    assert sorted(released) == sorted(b.admit_rows[0] for b in d.batches if b.admit_rows)
    assert d.finished["a"].completion_tokens == 6 and d.finished["b"].completion_tokens == 2


def test_admission_waits_for_a_free_row():
    s = make_scheduler(max_running=2)
    d = Driver(s)
    for i in range(3):
        d.collect(s.add(f"r{i}", [1], params(3)))
    first = d.step()
    assert len(first.rows) == 2 and len(s.queue) == 1
    d.run()
    assert len(d.finished) == 3


def test_abort_queued_is_answered_at_once():
    s = make_scheduler(max_running=1)
    d = Driver(s)
    d.collect(s.add("a", [1], params(5)))
    d.collect(s.add("b", [1], params(5)))
    d.step()
    d.collect(s.abort("b"))
    assert d.finished["b"].reason == "abort" and "b" not in s.requests
    d.run()
    assert d.finished["a"].reason == "length"


def test_abort_running_finishes_through_the_next_result():
    s = make_scheduler()
    d = Driver(s)
    d.collect(s.add("a", [1], params(50)))
    d.step(); d.step()
    before = len(d.tokens["a"])
    # Marked while a step is in flight: the runner may still touch the row.
    batch = s.schedule()
    d.collect(s.abort("a"))
    assert "a" not in d.finished and s.requests["a"].row in batch.rows
    d.collect(s.on_result(m.StepResult(step=batch.step, rows=batch.rows, tokens=[7])))
    assert d.finished["a"].reason == "abort"
    assert len(d.tokens["a"]) == before  # the token of the aborted step is not emitted
    assert s.idle and s.leaks() == {"rows": [], "slots": [], "requests": []}


def test_abort_between_steps_ends_at_next_schedule():
    s = make_scheduler()
    d = Driver(s)
    d.collect(s.add("a", [1], params(50)))
    d.step()
    d.collect(s.abort("a"))
    assert "a" not in d.finished
    last = d.step()
    assert last.rows == [] and last.release_rows == [1]
    assert d.finished["a"].reason == "abort" and s.idle


def test_context_length_bounds_prompt_and_output():
    s = make_scheduler(context_length=8)
    d = Driver(s)
    d.collect(s.add("long", list(range(8)), params(4)))
    assert d.finished["long"].reason == "error" and d.finished["long"].code == 400
    assert "context" in d.finished["long"].message
    d.collect(s.add("fits", list(range(5)), params(100)))
    d.run()
    assert d.finished["fits"].reason == "length"
    assert 5 + len(d.tokens["fits"]) == 8


def test_duplicate_rid_is_rejected_without_touching_the_first():
    s = make_scheduler()
    d = Driver(s)
    d.collect(s.add("a", [1], params(2)))
    d.collect(s.add("a", [1], params(2)))
    assert d.finished["a"].reason == "error"
    del d.finished["a"]
    d.run()
    assert d.finished["a"].reason == "length"


def test_runner_error_ends_the_step_requests_with_error():
    s = make_scheduler()
    d = Driver(s)
    d.collect(s.add("a", [1], params(5)))
    batch = s.schedule()
    d.collect(s.on_result(m.StepResult(step=batch.step, rows=[], tokens=[], error="boom")))
    assert d.finished["a"].reason == "error" and "boom" in d.finished["a"].message
    assert s.idle and s.leaks() == {"rows": [], "slots": [], "requests": []}


class FailsOnce(Scripted):
    """Fails one step, as a runner whose forward raised: it then keeps nothing of what it held
    (actors/model_runner/actor.py, reset), so this fake forgets every row's position too."""

    def __init__(self, sched, fail_step, scripts):
        super().__init__(sched, scripts)
        self.fail_step = fail_step

    def step(self, batch):
        if batch.step == self.fail_step:
            self.index.clear()
            return m.StepResult(step=batch.step, rows=[], tokens=[], error="boom")
        return super().step(batch)


def test_after_a_failed_step_no_prefix_from_before_is_used_and_bystanders_are_recomputed():
    """A prefix cached before a failed step points at runner memory that is gone: a later
    request with that prompt computes it all (nothing copied, no cached tokens). A request
    running beside the failed step, but not in it, is recomputed and gets its tokens."""
    s = make_scheduler(prefix_cache=True, prefill_first=True)
    scripts = {"cached": [7, EOS], "again": [7, EOS], "by": [5, 6, 8, 9, EOS]}
    d = Driver(s, FailsOnce(s, fail_step=-1, scripts=scripts))
    prompt = list(range(1, 9))
    d.add("cached", prompt, params(4))
    d.run()
    assert s.memory.tree.cached_tokens >= len(prompt) - 1
    d.add("by", [20, 21, 22], params(8))
    while len(d.tokens.get("by", [])) < 2:
        d.step()
    # More wait than decode: with prefill_first the next step only prefills, "by" is held.
    d.add("x1", [30, 31], params(2))
    d.add("x2", [40, 41], params(2))
    d.runner.fail_step = s.step + 1
    failed = d.build()
    assert s.requests["by"].row not in failed.rows
    d.land()
    assert {d.finished[r].reason for r in ("x1", "x2")} == {"error"}
    assert "boom" in d.finished["x1"].message and "by" not in d.finished
    assert s.memory.tree.cached_tokens == 0 and not s.memory.lost
    after = len(d.batches)
    d.add("again", prompt, params(4))
    d.run()
    assert d.finished["again"].cached_tokens == 0
    assert not [op for b in d.batches[after:] for op in b.ops if op.kind == m.OpKind.KV_COPY]
    assert d.tokens["again"] == [7, EOS]
    assert d.finished["by"].reason == "stop" and d.tokens["by"] == [5, 6, 8, 9, EOS]
    assert s.idle and s.leaks() == {"rows": [], "slots": [], "requests": []}


def test_long_prompts_are_chunked_beside_running_decodes():
    s = make_scheduler(chunk=4)
    d = Driver(s)
    d.collect(s.add("run", [1], params(30)))
    d.step()
    d.collect(s.add("big", list(range(10)), params(2)))
    chunks = [d.step() for _ in range(3)]
    # Every step decodes "run" and prefills the next chunk of "big": 4 + 4 + 2 tokens.
    assert [b.future for b in chunks] == [[True, False]] * 3
    assert [b.input_lens[1] for b in chunks] == [4, 4, 2]
    assert [b.start_pos[1] for b in chunks] == [0, 4, 8]
    assert [b.sample[1] for b in chunks] == [False, False, True]
    assert unpack_ids(chunks[1].input_ids) == [4, 5, 6, 7]
    d.run()
    assert d.finished["big"].completion_tokens == 2


def test_finished_at_step_n_while_in_step_n_plus_1_keeps_its_row_until_that_returns():
    s = make_scheduler(max_running=2)
    s.add("x", [1, 2], params(10))
    s.add("filler", [3], params(10))
    step1 = s.schedule()  # prefill x and filler
    step2 = s.schedule()  # overlap: decode both on futures, before step 1's result
    x_row = step1.rows[0]
    assert step2.future == [True, True] and x_row in step2.rows
    out = s.on_result(m.StepResult(step=1, rows=step1.rows, tokens=[5, 6]))
    assert out.tokens == {"x": [5], "filler": [6]}
    step3 = s.schedule()  # built before step 2's result: x is in it again
    assert x_row in step3.rows
    out = s.on_result(m.StepResult(step=2, rows=step2.rows, tokens=[EOS, 7]))
    assert out.tokens == {"x": [EOS], "filler": [7]}
    assert [(f.rid, f.reason) for f in out.finished] == [("x", "stop")]
    # x finished at step 2 but step 3 still references its row: not free, not reusable.
    assert x_row in s.rows.owned and s.rows.available == 0
    s.add("y", [4], params(3))
    step4 = s.schedule()
    assert step4.admit_rows == [] and x_row not in step4.release_rows
    out = s.on_result(m.StepResult(step=3, rows=step3.rows, tokens=[8, 9]))
    assert "x" not in out.tokens  # x's token from step 3 is dropped
    assert out.tokens == {"filler": [9]} and out.finished == []
    assert x_row not in s.rows.owned
    step5 = s.schedule()
    assert x_row in step5.release_rows  # the runner drops x's state...
    assert step5.admit_rows == [x_row]  # ...before y takes the row in the same step


def test_abort_mid_chunked_prefill_is_torn_down_at_the_next_pass():
    s = make_scheduler(chunk=4)
    s.add("long", list(range(1, 13)), params(5))
    first = s.schedule()  # chunk 1 of 3
    second = s.schedule()  # overlap: chunk 2 built before chunk 1 returned
    assert first.input_lens == [4] and second.start_pos == [4]
    s.abort("long")
    # The next pass builds nothing: no more chunks for it, and its row is not released while
    # two steps carry it.
    assert s.schedule() is None
    out = s.on_result(m.StepResult(step=1, rows=[], tokens=[]))
    assert [(f.rid, f.reason) for f in out.finished] == [("long", "abort")]
    assert s.rows.owned  # chunk 2 is still in flight: the row and slots stay held
    out = s.on_result(m.StepResult(step=2, rows=[], tokens=[]))
    assert out.finished == [] and not s.rows.owned and not s.kv.owned
    assert s.schedule().release_rows == [first.rows[0]]


def test_queue_full_is_refused_at_once_with_503():
    s = make_scheduler(max_running=1, max_queued=2)
    outs = [s.add(f"r{i}", [1], params(3)) for i in range(3)]
    assert [o.finished for o in outs[:2]] == [[], []]
    assert outs[2].finished[0].reason == "error" and outs[2].finished[0].code == 503
    assert "queue full" in outs[2].finished[0].message


def test_a_prompt_that_can_never_fit_is_refused_at_once():
    s = make_scheduler(kv_slots=16, output_reserve=4)
    out = s.add("big", list(range(14)), params(10))
    assert out.finished[0].code == 400 and "KV slots" in out.finished[0].message
    assert s.add("ok", list(range(12)), params(10)).finished == []


# -- prefill first (scheduler.prefill_first) ------------------------------------------------


def _burst(prefill_first, max_running=8, kv_slots=4096, burst=6, prompt=(1, 2, 3, 4)):
    """One request decoding, then `burst` more at once, one prompt per step (chunk 4)."""
    s = make_scheduler(max_running=max_running, chunk=4, kv_slots=kv_slots,
                       prefill_first=prefill_first)
    d = Driver(s)
    d.collect(s.add("a", [1, 2], params(12)))
    d.step(); d.step()
    for i in range(burst):
        d.collect(s.add(f"r{i}", list(prompt), params(3)))
    return s, d


def test_a_burst_prefills_first_until_the_decoders_are_as_many_as_those_waiting():
    s, d = _burst(prefill_first=True)
    holds = [(d.step().hold_decode, len(s.queue)) for _ in range(5)]
    # 1 decoder and 6 waiting, 2 and 5, 3 and 4: held; 4 decoders and 3 waiting: decode.
    assert holds == [(True, 5), (True, 4), (True, 3), (False, 2), (False, 1)]
    for batch in d.batches[2:5]:
        assert batch.hold_decode and not any(batch.future) and batch.admit_rows
    assert sum(d.batches[5].future) == 4
    d.run()
    assert {rid: f.completion_tokens for rid, f in d.finished.items()} == {
        "a": 12, **{f"r{i}": 3 for i in range(6)}}
    assert d.tokens["a"] == [1000 + i for i in range(12)]  # no token lost or doubled


def test_prefill_first_off_decodes_in_every_step():
    s, d = _burst(prefill_first=False)
    d.run()
    assert not any(b.hold_decode for b in d.batches)
    assert all(any(b.future) for b in d.batches[2:7])
    assert len(d.finished) == 7


def test_full_rows_end_the_hold():
    s, d = _burst(prefill_first=True, max_running=3)
    assert [d.step().hold_decode for _ in range(3)] == [True, True, False]
    d.run()
    assert len(d.finished) == 7


def test_a_head_that_cannot_be_admitted_does_not_hold_the_decoders():
    # 'a' holds one of 2 KV pages: a 20-token prompt and its output reserve do not fit until
    # it ends.
    s, d = _burst(prefill_first=True, kv_slots=2 * m.KV_PAGE, burst=3, prompt=range(20))
    batch = d.step()
    assert not batch.hold_decode and batch.future == [True] and len(s.queue) == 3
    d.run()
    assert len(d.finished) == 4


def test_decode_needs_room_only_where_a_row_crosses_into_a_new_page():
    """Two pages, two requests on one each: they decode with no page free until the first
    crosses into its second; then the one with fewer tokens (the newest on a tie) is
    retracted, and recomputed once the other ends."""
    s = make_scheduler(kv_slots=2 * m.KV_PAGE, output_reserve=0)
    d = Driver(s)
    d.add("a", [1, 2, 3, 4], params(14))
    d.add("b", [5, 6, 7, 8], params(14))
    batches = [d.build()]
    while not s.retractions:
        d.land()
        batches.append(d.build())
    assert all(len(b.rows) == 2 and max(b.start_pos) < m.KV_PAGE for b in batches[:-1])
    crossing = batches[-1]
    assert crossing.start_pos == [m.KV_PAGE] and crossing.rows == [s.requests["a"].row]
    assert [(op.kind, op.start) for op in crossing.ops] == [(m.OpKind.PAGES, 1)]
    d.run()
    assert d.tokens == {rid: [1000 + i for i in range(14)] for rid in ("a", "b")}
    assert s.retractions == 1 and s.kv.pages_free == s.kv.pages_total
