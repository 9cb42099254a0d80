"""Hypothesis drives the real scheduler core with arrivals, aborts, early stops and memory
pressure, one or two steps in flight, against a fake model (the model, not the policy, is fake),
through the scheduler tests' one loop (tests/support/driver.py).

The fake runner keeps each row's token sequence exactly as the ForwardBatches build it and
samples a deterministic function of it, so every request has a reference continuation: a lost,
repeated or misplaced token, a wrong position, a future read before it was written, or state
reused across requests shows up as a mismatch."""

from __future__ import annotations

import os

from hypothesis import event, given, settings, strategies as st

from protocol import messages as m
from protocol.codec import unpack_ids
from actors.scheduler.core import Scheduler
from actors.scheduler.request import Phase
from tests.support.driver import Driver

EOS = 99


def next_token(seq: list[int]) -> int:
    # The whole sequence matters: a wrong token anywhere in a reused prefix shows up.
    h = hash(tuple(seq)) & 0xFFFFFFFF
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
    """Plays the runner's memory contract: working sequences per row, a KV pool by slot (the
    token at that position), and for hybrid models a state pool by slot (a digest of every
    token seen), written through after each step. Sampling reads the KV sequence, and in
    hybrid mode must agree with the state, so a wrong load, save, copy, snapshot or clear
    changes the tokens. The head's input kept with a state (Op.head_input) is the digest where
    the row last sampled; a row with no token to run samples from the one its state kept."""

    def __init__(self, hybrid: bool):
        self.hybrid = hybrid
        self.seq: dict[int, list[int]] = {}
        self.buf: dict[int, int] = {}
        self.kv: dict[int, int] = {}
        self.states: dict[int, int] = {}
        self.row_state: dict[int, int] = {}
        self.pending: dict[int, list[int]] = {}
        self.head: dict[int, int] = {}  # row -> digest of its sequence where it last sampled
        self.kept_head: dict[int, int] = {}  # state slot -> the head input kept with it
        self.sampled_only = 0  # rows that ran no token and sampled from a kept head input

    def _keep_head(self, op: m.Op, row: int, slot: int) -> None:
        self.kept_head.pop(slot, None)
        if op.head_input:
            assert self.head.get(row) == self.states[op.src], "head input kept where the row " \
                "did not sample"
            self.kept_head[slot] = self.head[row]

    def step(self, batch: m.ForwardBatch) -> m.StepResult:
        assert not (batch.hold_decode and any(batch.future)), "a row decodes in a held step"
        for op in batch.ops:
            if op.kind == m.OpKind.CLEAR:
                self.states[op.dst] = 0
                self.kept_head.pop(op.dst, None)
            elif op.kind == m.OpKind.COPY:
                self.states[op.dst] = self.states[op.src]
                self.kept_head.pop(op.dst, None)
                if op.src in self.kept_head:
                    self.kept_head[op.dst] = self.kept_head[op.src]
            elif op.kind == m.OpKind.SNAPSHOT:
                self.states[op.dst] = self.states[op.src]
                row = next(r for r, slot in self.row_state.items() if slot == op.src)
                self._keep_head(op, row, op.dst)
            elif op.kind == m.OpKind.KV_SAVE:
                for i, slot in enumerate(unpack_ids(op.slots)):
                    self.kv[slot] = self.seq[op.dst][op.start + i]
            elif op.kind == m.OpKind.KV_LOAD:
                self.pending[op.dst] = unpack_ids(op.slots)
            elif op.kind == m.OpKind.DONATE:
                self._keep_head(op, op.dst, op.src)
                assert self.row_state.pop(op.dst) == op.src, "donated a state the row does not own"
        for row in batch.release_rows:
            for d in (self.seq, self.buf, self.row_state, self.head):
                d.pop(row, None)
        for row, state in zip(batch.admit_rows, batch.admit_states):
            self.row_state[row] = state
            self.head.pop(row, None)
        ids, at, out_rows, tokens = unpack_ids(batch.input_ids), 0, [], []
        for row, n, start, fut, smp in zip(batch.rows, batch.input_lens, batch.start_pos,
                                           batch.future, batch.sample):
            if fut:
                assert row in self.buf, f"future of row {row} read before it was written"
                chunk = [self.buf[row]]
            else:
                chunk, at = ids[at:at + n], at + n
                if row not in self.seq or start == 0 or row in self.pending:
                    self.seq[row] = [self.kv[s] for s in self.pending.pop(row, [])]
            assert start == len(self.seq[row]), f"row {row}: position {start}, has {len(self.seq[row])}"
            self.seq[row].extend(chunk)
            if self.hybrid:
                slot = self.row_state[row]
                for tok in chunk:
                    self.states[slot] = hash((self.states[slot], tok)) & 0xFFFFFFFF
                assert self.states[slot] == digest(self.seq[row]), f"row {row}: state drifted"
            if not fut and not n:  # nothing to run: samples from the head input kept
                kept = self.kept_head.get(self.row_state.get(row))
                assert kept == digest(self.seq[row]), f"row {row}: no head input to sample"
                self.sampled_only += 1
            if chunk:
                self.head.pop(row, None)
            if smp:
                self.head[row] = digest(self.seq[row])
                self.buf[row] = next_token(self.seq[row])
                out_rows.append(row)
                tokens.append(self.buf[row])
        return m.StepResult(step=batch.step, rows=out_rows, tokens=tokens)


def digest(seq: list[int]) -> int:
    state = 0
    for start in range(len(seq)):
        state = hash((state, seq[start])) & 0xFFFFFFFF
    return state


def check_invariants(s: Scheduler) -> None:
    live = list(s.requests.values())
    rows = [r.row for r in live if r.row]
    assert len(rows) == len(set(rows)), "a row owned twice"
    assert set(rows) == s.rows.owned
    own = [x for r in live for x in r.slots[r.tree_len:]]
    tree = [x for n in s.memory.tree.walk() for x in n.slots] if s.memory.tree else []
    assert len(own + tree) == len(set(own + tree)), "a slot owned twice"
    assert set(own + tree) == s.slots.owned
    for r in live:  # the counters of request.py hold together
        assert r.tree_len <= r.filled <= len(r.fill) and len(r.output) <= r.sampled
        if r.row:  # holding memory: one slot per position a built step writes
            assert r.filled <= r.kv_len and len(r.slots) == max(len(r.fill), r.kv_len)
        if r.phase is Phase.RUNNING and not r.aborted:  # what is missing is still in flight
            assert r.sampled - len(r.output) <= r.inflight
    for r in live:  # a request's cached prefix is exactly its locked tree path
        if r.tree_len:
            assert r.lock is not None and s.memory.tree.path_slots(r.lock) == r.slots[:r.tree_len]
    if s.memory.states is not None:
        states = [r.state for r in live if r.state >= 0]
        held = [n.state for n in s.memory.tree.walk() if n.state is not None] \
            if s.memory.tree else []
        assert len(states + held) == len(set(states + held)), "a state slot owned twice"
        assert set(states + held) == s.memory.states.owned
    for batch, carried in s.futures.pinned():
        assert set(batch.rows) <= s.rows.owned, "a row referenced in flight is free"
        for req in carried:
            assert req.inflight > 0 and set(req.slots) <= s.slots.owned


# Prompts are a shared base (so prefixes repeat and the cache hits) plus a suffix.
BASES = [[7 + (b * 13 + i * 5) % 80 for i in range(24)] for b in range(3)]
arrive = st.tuples(st.just("arrive"), st.integers(0, 2), st.integers(4, 16), st.integers(1, 5),
                   st.integers(1, 16))
# n choices of one prompt (a group): the prompt is computed once and shared.
choices = st.tuples(st.just("choices"), st.integers(0, 2), st.integers(4, 16),
                    st.integers(1, 5), st.integers(1, 16), st.integers(2, 3))
ops = st.lists(st.one_of(arrive, arrive, choices,
                         st.tuples(st.just("abort"), st.integers(0, 30)),
                         st.tuples(st.just("tick"), st.booleans()),
                         st.tuples(st.just("tick"), st.booleans())),
               min_size=20, max_size=100)


@settings(max_examples=int(os.environ.get("MAS_HYPOTHESIS_EXAMPLES", 300)), deadline=None)
@given(ops=ops, rows=st.integers(1, 4), depth=st.integers(1, 2), chunk=st.integers(1, 16),
       kv=st.integers(32, 120), reserve=st.integers(0, 4), context=st.integers(20, 40),
       prefix=st.booleans(), hybrid=st.booleans(), spare_states=st.integers(0, 6),
       interval=st.integers(0, 6), head_input=st.booleans(), prefill_first=st.booleans())
def test_any_sequence_keeps_the_invariants_and_answers_everyone_once(
        ops, rows, depth, chunk, kv, reserve, context, prefix, hybrid, spare_states, interval,
        head_input, prefill_first):
    s = Scheduler(max_running=rows, context_length=context, eos_ids=[EOS],
                  chunked_prefill_size=chunk, kv_slots=kv, max_queued=1000,
                  output_reserve=reserve, prefix_cache=prefix,
                  state_slots=rows + spare_states if hybrid else 0, snapshot_interval=interval,
                  head_input=head_input, prefill_first=prefill_first)
    runner = FakeRunner(hybrid)
    # Every build and landing checks the invariants; the driver checks that each request gets
    # one terminal reply and no token after it.
    d = Driver(s, runner, depth, check=check_invariants)
    prompts, params = {}, {}

    for op in ops:
        if op[0] == "arrive":
            rid = f"r{len(prompts)}"
            _, base, keep, extra, max_new = op
            prompts[rid] = BASES[base][:keep] + [90 + (len(prompts) + i) % 9 for i in range(extra)]
            params[rid] = m.SamplingParams(max_new_tokens=max_new)
            d.add(rid, prompts[rid], params[rid])
        elif op[0] == "choices":
            _, base, keep, extra, max_new, n = op
            prompt = BASES[base][:keep] + [90 + (len(prompts) + i) % 9 for i in range(extra)]
            group = f"g{len(prompts)}"
            for _ in range(n):
                rid = f"r{len(prompts)}"
                prompts[rid], params[rid] = prompt, m.SamplingParams(max_new_tokens=max_new)
                d.add(rid, prompt, params[rid], group=group)
        elif op[0] == "abort" and prompts:
            d.abort(f"r{op[1] % len(prompts)}")
        elif op[0] == "tick":
            # late: land a result, then build (so aborts and arrivals meet two steps in
            # flight); otherwise build first, as the actor does when it wakes with no result.
            d.step(late=op[1])
        check_invariants(s)

    d.run(limit=5000)
    finished = d.finished
    event(f"retractions: {min(s.retractions, 3)}")
    event(f"prefix hits: {min(s.memory.hits, 3)}")
    event(f"rows sampled from a kept head input: {min(runner.sampled_only, 3)}")
    event(f"reasons: {sorted({f.reason for f in finished.values()})}")
    leaks = s.leaks()
    assert s.idle and all(not v for v in leaks.values()), leaks
    assert s.rows.available == rows
    if s.memory.tree is not None and not prefix:
        assert s.memory.tree.cached_tokens == 0, "no cache across requests with prefix off"
    if s.memory.tree is not None:
        s.memory.tree.check()
        assert s.slots.available + s.memory.tree.cached_tokens == kv
        s.memory.tree.evict(kv)
    assert s.slots.available == kv
    if s.memory.states is not None:
        s.memory.tree and s.memory.tree.evict_states(10**6)
        assert s.memory.states.available == s.memory.states.capacity
    assert set(finished) == set(prompts), "every request gets exactly one terminal reply"
    for rid, fin in finished.items():
        got = d.tokens.get(rid, [])
        ref, reason = reference(prompts[rid], params[rid], context)
        assert got == ref[:len(got)], f"{rid}: tokens differ from the reference"
        if fin.reason == "stop" or (fin.reason == "length" and got == ref):
            assert got == ref and fin.reason == reason
        elif fin.reason == "length":
            # Only the server's whole KV capacity may cut a request short.
            assert len(prompts[rid]) + len(got) >= kv
        else:
            assert fin.reason in ("abort", "error")
            if fin.reason == "error":
                assert "KV slots" in fin.message or "context" in fin.message
        assert fin.completion_tokens == len(got)
