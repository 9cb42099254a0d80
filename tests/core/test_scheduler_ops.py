"""The deferred op queue (docs/architecture.md, section 6), as the scheduler core emits it with
the prefix cache on, for a hybrid model and a dense one: the right ops, in the right order, in
the right batch. KV never moves but for a prefix hit's partial pages: a request writes its
pages, the tree takes its slots in place, and a hit reads whole pages where they are."""

from protocol import messages as m
from protocol.codec import unpack_ids
from protocol.messages import KV_PAGE
from actors.scheduler.core import Scheduler
from tests.support.driver import Driver, Scripted

EOS = 99
P = m.SamplingParams


def make(chunk=4, kv=256, states=8, interval=0, head_input=False):
    return Scheduler(max_running=4, context_length=128, eos_ids=[EOS], chunked_prefill_size=chunk,
                     kv_slots=kv, state_slots=states, prefix_cache=True,
                     snapshot_interval=interval, head_input=head_input)


def kinds(batch):
    return [op.kind for op in batch.ops]


def table(op):
    """A PAGES op: (row, start, pages)."""
    assert op.kind == m.OpKind.PAGES
    return op.dst, op.start, unpack_ids(op.slots)


def copied(op):
    """A KV_COPY op: (source slots, destination slots)."""
    assert op.kind == m.OpKind.KV_COPY
    ids = unpack_ids(op.slots)
    return ids[:len(ids) // 2], ids[len(ids) // 2:]


def slots(page, start, end):
    return [page * KV_PAGE + j for j in range(start, end)]


def driver(s, scripts=None):
    """Steps built by hand (d.build(): to look at them, or to build the next before landing
    one) or run to the end; a sampled row gets its request's scripted token, past it EOS."""
    return Driver(s, Scripted(s, scripts, default=EOS))


def test_fresh_request_gets_its_page_table_and_a_clear_of_its_live_state():
    s = make()
    s.add("a", [1, 2, 3], P(max_new_tokens=1))
    b = s.schedule()
    assert kinds(b) == [m.OpKind.PAGES, m.OpKind.CLEAR]
    assert table(b.ops[0]) == (b.rows[0], 0, [1])  # page 0 is the runner's scratch page
    assert b.ops[1].dst == b.admit_states[0] >= 0


def test_chunk_boundary_snapshots_the_live_state_in_the_batch_of_the_next_chunk():
    s = make(chunk=4)
    s.add("a", list(range(1, 11)), P(max_new_tokens=2))
    first = s.schedule()
    live = first.admit_states[0]
    assert kinds(first) == [m.OpKind.PAGES, m.OpKind.CLEAR]
    second = s.schedule()  # chunk 2 (overlap: built before chunk 1 returned)
    # The state after chunk 1 is snapshotted before chunk 2 runs; its KV stays where chunk 1
    # writes it, and the tree holds those slots.
    assert kinds(second) == [m.OpKind.SNAPSHOT]
    snap = second.ops[0]
    assert snap.src == live and snap.dst not in (live, -1)
    assert second.start_pos == [4] and second.input_lens == [4]
    assert s.memory.tree.match([1, 2, 3, 4]).slots == slots(1, 0, 4)


def test_finish_donates_the_live_slot_and_a_hit_copies_it():
    s = make(chunk=64)
    d = driver(s, {"a": [7], "b": [7]})
    prompt = list(range(1, 11))
    s.add("a", prompt, P(max_new_tokens=1))
    b = d.build()
    live = b.admit_states[0]
    # The chunk ends before the prompt's last token, so the state there is snapshotted.
    assert b.input_lens == [9] and table(b.ops[0])[2] == [1]
    last = d.build()
    assert kinds(last) == [m.OpKind.SNAPSHOT] and last.input_lens == [1]
    snapshot = last.ops[0].dst
    d.land()
    d.land()  # "a" samples 7: max_new_tokens=1 ends it here, nothing in flight
    release = d.build()
    # Its live state slot is donated (no copy, no snapshot), its row freed.
    assert kinds(release) == [m.OpKind.DONATE]
    assert release.release_rows == b.rows
    donate = release.ops[0]
    assert (donate.src, donate.dst) == (live, b.rows[0])
    node = s.memory.tree.match(prompt, need_state=True).node
    assert node.state == live and live in s.memory.states.owned  # now held by the tree
    d.land()
    # Same prompt again: the prefix (all but the last prompt token is usable) must resume
    # from a state snapshot: the one taken before the last prompt token. The 9 tokens fill
    # no page whole: they are copied into its own page (page 1 still holds the tree's).
    s.add("b", prompt, P(max_new_tokens=1))
    hit = d.build()
    assert kinds(hit) == [m.OpKind.PAGES, m.OpKind.KV_COPY, m.OpKind.COPY]
    pages, kv, copy = hit.ops
    assert table(pages) == (hit.rows[0], 0, [2])
    assert copied(kv) == (slots(1, 0, 9), slots(2, 0, 9))
    assert copy.src == snapshot and copy.dst == hit.admit_states[0] != live
    assert hit.start_pos == [9] and hit.input_lens == [1]
    d.land()  # "b" samples 7
    # A longer prompt resumes from the donated state at the end of the first request.
    s.add("c", prompt + [5, 6], P(max_new_tokens=1))
    longer = d.build()
    assert longer.start_pos == [10]
    assert kinds(longer)[-3:] == [m.OpKind.PAGES, m.OpKind.KV_COPY, m.OpKind.COPY]
    assert copied(longer.ops[-2])[0] == slots(1, 0, 10) and longer.ops[-1].src == live
    d.land()
    d.run()
    assert not any(s.leaks().values())


def test_abort_between_scheduling_and_execution_leaves_no_orphan_state_slot():
    s = make(chunk=4)
    d = driver(s)
    s.add("a", list(range(1, 11)), P(max_new_tokens=5))
    d.build()
    second = d.build()  # holds a SNAPSHOT into a fresh node slot
    snap_dst = second.ops[-1].dst
    s.abort("a")
    # The next pass builds nothing: no third chunk for it, and its row, KV and state slots
    # stay held (no release, no op) while the two steps in flight carry it.
    assert d.build() is None and s.requests["a"].row in s.rows.owned
    d.land()
    d.land()
    d.run()
    leaks = s.leaks()
    assert not any(leaks.values()), leaks
    # Every state slot is free or held by a tree node (the snapshot and, if donated, the
    # live slot): none is owned by nobody.
    held = {n.state for n in s.memory.tree.walk() if n.state is not None}
    assert s.memory.states.owned == held and snap_dst in held
    s.memory.tree.evict(10**6)
    assert s.memory.states.available == s.memory.states.capacity


def test_without_the_prefix_cache_only_clears():
    s = Scheduler(max_running=2, context_length=64, eos_ids=[EOS], chunked_prefill_size=4,
                  kv_slots=64, state_slots=4, prefix_cache=False)
    s.add("a", list(range(1, 11)), P(max_new_tokens=2))
    batches = driver(s, {"a": [7, 7]}).run().batches
    assert [k for b in batches for k in kinds(b)] == [m.OpKind.PAGES, m.OpKind.CLEAR]
    assert s.memory.states.available == 4


def test_n_choices_compute_the_prompt_once():
    s = make(chunk=64)
    d = driver(s, {f"c{k}": [7] for k in range(3)})
    prompt = list(range(1, 21))
    for k in range(3):
        s.add(f"c{k}", prompt, P(max_new_tokens=3), group="g")
    first = d.build()
    # One sibling prefills all but the last prompt token; the others wait for it.
    assert first.input_lens == [19] and len(first.admit_rows) == 1
    second = d.build()
    # Built while the first chunk is in flight: the 19 tokens are cached at this chunk
    # boundary (first in the op list), so the siblings join in this very step, each reading
    # the leader's first page in place, copying the 3 tokens after it and computing only the
    # last token, like the leader.
    assert second.input_lens == [1, 1, 1] and second.start_pos == [19, 19, 19]
    assert kinds(second) == [m.OpKind.SNAPSHOT] + [m.OpKind.PAGES, m.OpKind.KV_COPY,
                                                   m.OpKind.COPY] * 2
    snapshot = second.ops[0].dst
    leader = table(first.ops[0])[2]
    for pages, kv in ((second.ops[1], second.ops[2]), (second.ops[4], second.ops[5])):
        own = table(pages)[2]
        assert own[0] == leader[0] and own[1] not in leader
        assert copied(kv) == (slots(leader[1], 0, 3), slots(own[1], 0, 3))
    assert all(op.src == snapshot for op in second.ops if op.kind == m.OpKind.COPY)
    d.run()  # lands both, each choice sampling 7, then runs them to the end
    assert not any(s.leaks().values())


def test_n_choices_share_the_prompt_without_the_prefix_cache_and_leave_nothing_cached():
    s = Scheduler(max_running=4, context_length=128, eos_ids=[EOS], chunked_prefill_size=64,
                  kv_slots=256, state_slots=8, prefix_cache=False)
    d = driver(s, {"lone": [7, 7], **{f"c{k}": [7] for k in range(3)}})
    s.add("lone", list(range(30, 40)), P(max_new_tokens=2))
    for k in range(3):
        s.add(f"c{k}", list(range(1, 21)), P(max_new_tokens=3), group="g")
    first = d.build()
    assert sorted(first.input_lens) == [10, 19]  # the lone request is not cached at all
    second = d.build()
    # The lone request decodes at position 10; the three choices compute only the last token.
    assert second.input_lens == [1, 1, 1, 1] and sorted(second.start_pos) == [10, 19, 19, 19]
    assert kinds(second).count(m.OpKind.KV_COPY) == 2
    d.run()  # lands both (every row samples 7), then runs them to the end
    assert not any(s.leaks().values())
    assert s.memory.tree.cached_tokens == 0 and s.memory.states.available == 8
    s.add("again", list(range(1, 21)), P(max_new_tokens=1))  # a later request: no hit
    assert s.schedule().input_lens == [20]


def test_a_shared_system_prompt_is_snapshotted_where_prompts_diverge():
    s = make(chunk=64)
    d = driver(s)
    system = list(range(1, 21))
    s.add("a", system + [30, 31, 32], P(max_new_tokens=1))
    d.run()
    # b shares 20 tokens with a, but a's snapshots are at its prompt's end and its finish
    # only: b resumes from nothing, and its first chunk ends where the two diverge.
    s.add("b", system + [40, 41, 42], P(max_new_tokens=1))
    first = d.build()
    assert first.start_pos == [0] and first.input_lens == [20]
    second = d.build()
    assert m.OpKind.SNAPSHOT in kinds(second) and second.start_pos == [20]
    d.run()
    # c resumes at the divergence snapshot: only its own question is computed.
    s.add("c", system + [50, 51], P(max_new_tokens=1))
    hit = d.build()
    assert hit.start_pos == [20]
    assert kinds(hit) == [m.OpKind.PAGES, m.OpKind.KV_COPY, m.OpKind.COPY]
    d.run()
    assert not any(s.leaks().values())


def test_hybrid_chunks_end_at_every_snapshot_interval_and_before_the_last_token():
    s = make(chunk=64, interval=8)
    s.add("a", list(range(1, 21)), P(max_new_tokens=1))  # 20 tokens
    chunks = [c for b in driver(s).run().batches for c in zip(b.start_pos, b.input_lens)]
    # Cuts at 8 and 16 (the interval) and 19 (the prompt's last token runs alone).
    assert chunks == [(0, 8), (8, 8), (16, 3), (19, 1)]
    assert not any(s.leaks().values())


# -- the head's input kept at a prompt's end (runner: ModelLayers.head_input) ------------------


def admitted(max_new_tokens, scripts):
    """A scheduler that keeps head inputs, after the first batch of a 10-token prompt of
    request "a" (not landed): (scheduler, its driver, prompt, that batch, the request's live
    state slot)."""
    s = make(chunk=64, head_input=True)
    d = driver(s, scripts)
    prompt = list(range(1, 11))
    s.add("a", prompt, P(max_new_tokens=max_new_tokens))
    b = d.build()
    return s, d, prompt, b, b.admit_states[0]


def test_an_exact_repeat_takes_the_whole_prompt_and_only_samples():
    s, d, prompt, b, live = admitted(max_new_tokens=1, scripts={"a": [7], "b": [5, EOS]})
    assert b.input_lens == [10] and b.sample == [True]  # no cut before the last token
    d.land()  # "a" samples 7
    release = d.build()
    # It ended after its prompt: the state donated there keeps the head's input too.
    assert kinds(release) == [m.OpKind.DONATE]
    assert release.ops[0].head_input and release.ops[0].src == live
    node = s.memory.tree.match(prompt, need_state=True).node
    assert node.state == live and node.head_input
    d.land()
    s.add("b", prompt, P(max_new_tokens=3))
    hit = d.build()
    assert kinds(hit) == [m.OpKind.PAGES, m.OpKind.KV_COPY, m.OpKind.COPY]
    assert hit.ops[2].src == live and len(copied(hit.ops[1])[0]) == 10
    # Its row runs no token: the runner samples from the head input the COPY brought.
    assert (hit.input_lens, hit.start_pos, hit.future, hit.sample) == ([0], [10], [False], [True])
    nxt = d.build()  # its first decode: its prompt's end is in the tree already
    assert nxt.future == [True] and nxt.start_pos == [10] and kinds(nxt) == []
    ended = [f for out in (d.land(), d.land()) for f in out.finished]  # "b" samples 5, EOS
    assert [(f.rid, f.cached_tokens) for f in ended] == [("b", 10)]
    d.run()
    assert not any(s.leaks().values())
    s.memory.tree.check()


def test_a_prompt_that_decodes_on_is_snapshotted_at_its_end_with_the_head_input():
    s, d, prompt, b, live = admitted(max_new_tokens=4, scripts={"a": [5, 6]})
    first_decode = d.build()
    assert kinds(first_decode) == [m.OpKind.SNAPSHOT]
    snap = first_decode.ops[0]
    assert snap.src == live and snap.head_input and snap.dst != live
    node = s.memory.tree.match(prompt, need_state=True).node
    assert node.state == snap.dst and node.head_input
    d.land()  # "a" samples 5
    d.land()  # and 6
    second_decode = d.build()
    assert kinds(second_decode) == []  # once per prompt
    d.land()  # and EOS
    d.run()
    # A later request with the same prompt resumes from that snapshot and only samples.
    s.add("b", prompt, P(max_new_tokens=1))
    hit = d.build()
    assert hit.input_lens == [0] and hit.ops[-1].src == snap.dst
    d.run()
    assert not any(s.leaks().values())


def test_a_snapshot_without_the_head_input_is_no_whole_prompt_hit():
    s = make(chunk=8, head_input=True)
    d = driver(s)
    s.add("a", list(range(1, 17)), P(max_new_tokens=1))
    d.run()  # chunks of 8: the state after 8 tokens is snapshotted, no head input
    node = s.memory.tree.match(list(range(1, 9)), need_state=True).node
    assert node.state is not None and not node.head_input
    s.add("b", list(range(1, 9)), P(max_new_tokens=1))  # exactly those 8 tokens
    b = d.build()
    # It cannot sample there, and nothing short of its last token is snapshotted: it runs.
    assert b.start_pos == [0] and b.input_lens == [8]
    d.run()
    # Its own end now keeps the head input, replacing the plain snapshot.
    node = s.memory.tree.match(list(range(1, 9)), need_state=True).node
    assert node.head_input
    s.memory.tree.check()
    assert not any(s.leaks().values())


# -- a dense model's page tables --------------------------------------------------------------


def served(prompt, **kw):
    """A dense model's scheduler after one request ("a") with this prompt ran to its end, the
    tree holding its whole prompt: (scheduler, driver, a's page table)."""
    s = Scheduler(max_running=4, context_length=256, eos_ids=[EOS], chunked_prefill_size=64,
                  kv_slots=1024, prefix_cache=True, **kw)
    d = driver(s)
    s.add("a", prompt, P(max_new_tokens=1))
    first = d.build()
    d.run()
    return s, d, table(first.ops[0])[2]


def test_a_hit_of_40_tokens_shares_two_pages_and_copies_8_slots():
    s, d, a = served(list(range(1, 42)))  # 41 tokens, on pages 1, 2 and 3
    assert a == [1, 2, 3]
    s.add("b", list(range(1, 41)) + [200, 201], P(max_new_tokens=1))
    hit = d.build()
    assert kinds(hit) == [m.OpKind.PAGES, m.OpKind.KV_COPY]
    row, start, pages = table(hit.ops[0])
    # Page 3 still holds the tree's 41st token: the new page is 4.
    assert (row, start, pages) == (hit.rows[0], 0, [1, 2, 4])
    assert copied(hit.ops[1]) == (slots(3, 0, 8), slots(4, 0, 8))
    assert (hit.start_pos, hit.input_lens) == ([40], [2])
    assert s.requests["b"].held == set(slots(4, 0, KV_PAGE))  # frees only its own page
    d.run()
    assert not any(s.leaks().values())
    s.memory.tree.check()


def test_a_hit_of_exactly_two_pages_copies_nothing():
    s, d, a = served(list(range(1, 34)))  # 33 tokens
    s.add("b", list(range(1, 33)) + [200, 201], P(max_new_tokens=1))
    hit = d.build()
    assert kinds(hit) == [m.OpKind.PAGES]
    assert table(hit.ops[0])[2][:2] == a[:2] and hit.start_pos == [32]
    d.run()
    assert not any(s.leaks().values())


def test_a_decode_row_that_crosses_into_a_new_page_extends_the_table():
    s = Scheduler(max_running=4, context_length=256, eos_ids=[EOS], chunked_prefill_size=64,
                  kv_slots=1024)
    d = driver(s, {"a": [5, 6, 7, 8]})
    s.add("a", list(range(1, 16)), P(max_new_tokens=4))  # 15 tokens: one page
    first = d.build()
    assert table(first.ops[0]) == (first.rows[0], 0, [1])
    d.land()
    last_slot = d.build()  # position 15, the page's last slot
    assert last_slot.start_pos == [15] and kinds(last_slot) == []
    d.land()
    crossing = d.build()
    assert crossing.start_pos == [16] and kinds(crossing) == [m.OpKind.PAGES]
    assert table(crossing.ops[0]) == (first.rows[0], 1, [2])
    assert s.requests["a"].pages == [1, 2]
    d.run()
    assert d.tokens["a"] == [5, 6, 7, 8]
    assert not any(s.leaks().values()) and s.kv.pages_free == s.kv.pages_total


def test_a_hit_whose_own_match_pins_the_pool_computes_its_prefix_when_alone():
    """Two pages, each holding a few of the tree's tokens (from two requests' inserts): a hit
    would copy from both while its lock keeps them, and no page is left for its own. Alone,
    it gives the hit up and computes its prompt, rather than wait for ever."""
    s = Scheduler(max_running=4, context_length=64, eos_ids=[EOS], chunked_prefill_size=64,
                  kv_slots=2 * KV_PAGE, output_reserve=0, prefix_cache=True)
    d = driver(s)
    d.add("a", [1, 2, 3, 4], P(max_new_tokens=1))
    d.run()
    d.add("b", [1, 2, 3, 4, 5, 6], P(max_new_tokens=1))  # copies 4, the tree takes 2 more
    d.run()
    assert s.kv.pages_free == 0 and s.memory.tree.cached_tokens == 6
    d.add("c", list(range(1, 11)), P(max_new_tokens=1))
    first = d.build()
    assert (first.start_pos, first.input_lens) == ([0], [10])
    assert kinds(first) == [m.OpKind.PAGES]
    d.run()
    assert d.finished["c"].cached_tokens == 0 and d.finished["c"].reason == "stop"
    assert not any(s.leaks().values())
