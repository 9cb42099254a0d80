"""Hypothesis drives the real scheduler core with arrivals, aborts, early stops and memory
pressure, one or two steps in flight, against a fake model (the model, not the policy, is fake).

The fake runner keeps each row's token sequence exactly as the ForwardBatches build it and
samples a deterministic function of it, so every request has a reference continuation: a lost,
repeated or misplaced token, a wrong position, a future read before it was written, or state
reused across requests shows up as a mismatch."""

from __future__ import annotations

from collections import deque

from hypothesis import event, given, settings, strategies as st

from protocol import messages as m
from protocol.codec import unpack_ids
from actors.scheduler.core import Scheduler

EOS = 99


def next_token(seq: list[int]) -> int:
    h = hash((tuple(seq[-3:]), len(seq))) & 0xFFFFFFFF
    return EOS if h % 23 == 0 else 100 + h % 50


def reference(prompt: list[int], params: m.SamplingParams, context: int) -> tuple[list[int], str]:
    seq, out = list(prompt), []
    while True:
        tok = next_token(seq)
        out.append(tok)
        seq.append(tok)
        if tok == EOS:
            return out, "stop"
        if len(out) >= params.max_new_tokens or len(seq) >= context:
            return out, "length"


class FakeRunner:
    def __init__(self):
        self.seq: dict[int, list[int]] = {}
        self.buf: dict[int, int] = {}

    def step(self, batch: m.ForwardBatch) -> m.StepResult:
        for row in batch.release_rows:
            self.seq.pop(row, None)
            self.buf.pop(row, None)
        ids, at, out_rows, tokens = unpack_ids(batch.input_ids), 0, [], []
        for row, n, start, fut, smp in zip(batch.rows, batch.input_lens, batch.start_pos,
                                           batch.future, batch.sample):
            if fut:
                assert row in self.buf, f"future of row {row} read before it was written"
                chunk = [self.buf[row]]
            else:
                chunk, at = ids[at:at + n], at + n
                if start == 0:
                    self.seq[row] = []
            assert start == len(self.seq[row]), f"row {row}: position {start}, has {len(self.seq[row])}"
            self.seq[row].extend(chunk)
            if smp:
                self.buf[row] = next_token(self.seq[row])
                out_rows.append(row)
                tokens.append(self.buf[row])
        return m.StepResult(step=batch.step, rows=out_rows, tokens=tokens)


def check_invariants(s: Scheduler) -> None:
    live = list(s.requests.values())
    rows = [r.row for r in live if r.row]
    assert len(rows) == len(set(rows)), "a row owned twice"
    assert set(rows) == s.rows.owned
    slots = [x for r in live for x in r.slots]
    assert len(slots) == len(set(slots)), "a slot owned twice"
    assert set(slots) == s.slots.owned
    for batch, carried in s.in_flight:
        assert set(batch.rows) <= s.rows.owned, "a row referenced in flight is free"
        for req in carried:
            assert req.inflight > 0 and set(req.slots) <= s.slots.owned


arrive = st.tuples(st.just("arrive"), st.integers(1, 16), st.integers(1, 16))
ops = st.lists(st.one_of(arrive, arrive, st.tuples(st.just("abort"), st.integers(0, 30)),
                         st.tuples(st.just("tick"), st.just(0)),
                         st.tuples(st.just("tick"), st.just(0))), min_size=4, max_size=80)


@settings(max_examples=400, deadline=None)
@given(ops=ops, rows=st.integers(1, 4), depth=st.integers(1, 2), chunk=st.integers(1, 16),
       kv=st.integers(32, 120), reserve=st.integers(0, 4), context=st.integers(20, 40))
def test_any_sequence_keeps_the_invariants_and_answers_everyone_once(ops, rows, depth, chunk,
                                                                     kv, reserve, context):
    s = Scheduler(max_running=rows, context_length=context, eos_ids=[EOS],
                  chunked_prefill_size=chunk, kv_slots=kv, max_queued=1000,
                  output_reserve=reserve)
    runner, results = FakeRunner(), deque()
    prompts, params, emitted, finished = {}, {}, {}, {}

    def collect(out) -> None:
        for rid, toks in out.tokens.items():
            assert rid not in finished, f"{rid} got tokens after its terminal reply"
            emitted.setdefault(rid, []).extend(toks)
        for fin in out.finished:
            assert fin.rid not in finished, f"{fin.rid} got two terminal replies"
            finished[fin.rid] = fin

    def tick() -> None:
        while len(s.in_flight) < depth and (batch := s.schedule()) is not None:
            results.append(runner.step(batch))
        collect(s.take())
        check_invariants(s)
        if results:
            collect(s.on_result(results.popleft()))
            check_invariants(s)

    for op in ops:
        if op[0] == "arrive":
            rid = f"r{len(prompts)}"
            prompts[rid] = [1 + (len(prompts) * 7 + i) % 90 for i in range(op[1])]
            params[rid] = m.SamplingParams(max_new_tokens=op[2])
            collect(s.add(rid, prompts[rid], params[rid]))
        elif op[0] == "abort" and prompts:
            collect(s.abort(f"r{op[1] % len(prompts)}"))
        else:
            tick()
        check_invariants(s)

    for _ in range(5000):
        if s.idle and not results:
            break
        tick()
    event(f"retractions: {min(s.retractions, 3)}")
    event(f"reasons: {sorted({f.reason for f in finished.values()})}")
    assert s.idle and s.leaks() == {"rows": [], "slots": [], "requests": []}
    assert s.rows.available == rows and s.slots.available == kv
    assert set(finished) == set(prompts), "every request gets exactly one terminal reply"
    for rid, fin in finished.items():
        got = emitted.get(rid, [])
        ref, reason = reference(prompts[rid], params[rid], context)
        assert got == ref[:len(got)], f"{rid}: tokens differ from the reference"
        if fin.reason in ("stop", "length") and fin.reason == reason:
            assert got == ref
        elif fin.reason == "length":
            # Only the server's whole KV capacity may cut a request short.
            assert len(prompts[rid]) + len(got) >= kv - reserve
        else:
            assert fin.reason in ("abort", "error")
            if fin.reason == "error":
                assert "KV slots" in fin.message or "context" in fin.message
        assert fin.completion_tokens == len(got)
