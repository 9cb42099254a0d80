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
from protocol.messages import KV_PAGE
from actors.scheduler.core import Scheduler
from actors.scheduler.pools import pages_for
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
    """Plays the runner's memory contract: one KV pool by slot (the token written there), a
    page table per row (PAGES ops; kept after release, as the runner does), and for hybrid
    models a state pool by slot (a digest of every token seen), written through after each
    step. A row writes its tokens through its page table and reads its whole sequence back
    the same way, and in hybrid mode that must agree with the state, so a wrong page table,
    copy, snapshot or clear, or a slot another request overwrote, changes the tokens. The
    head's input kept with a state (Op.head_input) is the digest where the row last sampled;
    a row with no token to run samples from the one its state kept."""

    def __init__(self, hybrid: bool):
        self.hybrid = hybrid
        self.buf: dict[int, int] = {}
        self.kv: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}
        self.states: dict[int, int] = {}
        self.row_state: dict[int, int] = {}
        self.pos: dict[int, int] = {}  # row -> the next position it runs
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
            elif op.kind == m.OpKind.PAGES:
                pages = unpack_ids(op.slots)
                assert 0 not in pages, "page 0 is the runner's scratch page"
                assert op.start <= len(self.tables.get(op.dst, [])), "a hole in a page table"
                self.tables[op.dst] = self.tables.get(op.dst, [])[:op.start] + pages
            elif op.kind == m.OpKind.KV_COPY:
                ids = unpack_ids(op.slots)
                src, dst = ids[:len(ids) // 2], ids[len(ids) // 2:]
                assert all(s % KV_PAGE == d % KV_PAGE for s, d in zip(src, dst)), \
                    "a KV copy to another position"
                for s, d in zip(src, dst):
                    self.kv[d] = self.kv[s]
            elif op.kind == m.OpKind.DONATE:
                self._keep_head(op, op.dst, op.src)
                assert self.row_state.pop(op.dst) == op.src, "donated a state the row does not own"
        for row in batch.release_rows:
            for d in (self.buf, self.row_state, self.head, self.pos):
                d.pop(row, None)
        for row in batch.admit_rows:
            self.pos.pop(row, None)  # its first chunk starts past its cached prefix
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
            assert self.pos.setdefault(row, start) == start, \
                f"row {row}: position {start}, expected {self.pos[row]}"
            self.pos[row] = start + len(chunk)
            for p, tok in enumerate(chunk, start):
                self.kv[self.slot(row, p)] = tok
            seq = [self.kv.get(self.slot(row, p)) for p in range(start + len(chunk))]
            assert None not in seq, f"row {row}: a position read before it was written"
            if self.hybrid:
                slot = self.row_state[row]
                for tok in chunk:
                    self.states[slot] = hash((self.states[slot], tok)) & 0xFFFFFFFF
                assert self.states[slot] == digest(seq), f"row {row}: state drifted"
            if not fut and not n:  # nothing to run: samples from the head input kept
                kept = self.kept_head.get(self.row_state.get(row))
                assert kept == digest(seq), f"row {row}: no head input to sample"
                self.sampled_only += 1
            if chunk:
                self.head.pop(row, None)
            if smp:
                self.head[row] = digest(seq)
                self.buf[row] = next_token(seq)
                out_rows.append(row)
                tokens.append(self.buf[row])
        return m.StepResult(step=batch.step, rows=out_rows, tokens=tokens)

    def slot(self, row: int, p: int) -> int:
        table = self.tables.get(row, [])
        assert p // KV_PAGE < len(table), f"row {row}: position {p} past its page table"
        return table[p // KV_PAGE] * KV_PAGE + p % KV_PAGE


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
    tree = s.memory.tree
    held = [x for r in live for x in r.held]
    cached = [x for n in tree.walk() for x in n.slots] if tree else []
    assert len(held + cached) == len(set(held + cached)), "a KV slot held twice"
    assert set(held + cached) == s.kv.owned
    assert s.kv.pages_free == s.kv.pages_total - len({x // KV_PAGE for x in s.kv.owned})
    for r in live:  # the counters of request.py hold together
        assert r.tree_len <= r.filled <= len(r.fill) and len(r.output) <= r.sampled
        if r.row:  # holding memory: its page table covers every position a built step writes
            assert r.filled <= r.kv_len
            assert len(r.pages) == pages_for(max(len(r.fill), r.kv_len))
            assert 0 not in r.pages and len(set(r.pages)) == len(r.pages)
            # what its next steps write is its own, never a page it shares
            assert set(r.slots(r.kv_len, len(r.pages) * KV_PAGE)) <= set(r.held)
        else:
            assert not r.pages and not r.held and r.lock is None
        if r.phase is Phase.RUNNING and not r.aborted:  # what is missing is still in flight
            assert r.sampled - len(r.output) <= r.inflight
    for r in live:  # a request's cached prefix is its locked tree path, read in place or copied
        if r.tree_len:
            path = tree.path_slots(r.lock)
            assert r.lock is not None and len(path) == r.tree_len
            assert all(t == x or x in r.held for t, x in zip(path, r.slots(0, r.tree_len)))
    if tree is not None:  # every slot the tree holds sits at its position's page offset
        stack = [(n, 0) for n in tree.root.children.values()]
        while stack:
            node, at = stack.pop()
            assert all(x % KV_PAGE == (at + i) % KV_PAGE for i, x in enumerate(node.slots))
            stack += [(c, at + len(node.key)) for c in node.children.values()]
    if s.memory.states is not None:
        states = [r.state for r in live if r.state >= 0]
        kept = [n.state for n in tree.walk() if n.state is not None] if tree else []
        assert len(states + kept) == len(set(states + kept)), "a state slot owned twice"
        assert set(states + kept) == s.memory.states.owned
    for batch, carried in s.futures.pinned():
        assert set(batch.rows) <= s.rows.owned, "a row referenced in flight is free"
        for req in carried:
            assert req.inflight > 0 and set(req.slots(0, req.kv_len)) <= s.kv.owned


def watch_length_cuts(s: Scheduler) -> dict[str, int]:
    """rid -> the pages a request's table and its locked tree path held when it ended by
    length: where KV memory cut it short, that is the whole pool."""
    cut: dict[str, int] = {}
    finish = s._finish

    def spy(req, reason, message=""):
        if reason == "length":
            path = s.memory.tree.path_slots(req.lock) if req.lock is not None else []
            cut[req.rid] = len(set(req.pages) | {x // KV_PAGE for x in path})
        finish(req, reason, message)

    s._finish = spy
    return cut


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
    cut = watch_length_cuts(s)

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
        # Idle: a page is free, or holds a slot of the tree.
        assert s.kv.pages_free + s.memory.tree.cached_pages == s.kv.pages_total
        s.memory.tree.evict(kv)
    assert s.kv.pages_free == s.kv.pages_total == kv // KV_PAGE
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
            # Only KV memory may cut a request short: its pages and those its cached prefix
            # pins in the tree (the pages it copied a partial page from) fill the pool.
            assert cut[rid] == s.kv.pages_total
        else:
            assert fin.reason in ("abort", "error")
            if fin.reason == "error":
                assert "KV slots" in fin.message or "context" in fin.message
        assert fin.completion_tokens == len(got)
