"""The radix prefix tree alone: matching and splitting, duplicates left to the caller, locks,
LRU eviction (by slots and by free pages), state slots, and a hypothesis state machine that
checks the tree against a flat reference model (cached prefix tuple -> slot) and the pools
after every operation."""

from __future__ import annotations

import pytest
from hypothesis import settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from actors.scheduler.pools import PagePool, SlotPool, page_slots
from actors.scheduler.radix import RadixCache
from protocol.messages import KV_PAGE


def make_cache(pages: int = 8, states: int | None = None) -> RadixCache:
    return RadixCache(PagePool(pages * KV_PAGE), SlotPool(states) if states else None)


def fresh(pool: PagePool, start: int, end: int) -> list[int]:
    """Slots for positions [start, end) on new pages, each at its position's page offset (as
    a request's page table places them); the pages' other slots go back at once."""
    if end <= start:
        return []
    pages = pool.alloc_pages((end - 1) // KV_PAGE - start // KV_PAGE + 1)
    got = [pages[p // KV_PAGE - start // KV_PAGE] * KV_PAGE + p % KV_PAGE
           for p in range(start, end)]
    pool.free(sorted({s for page in pages for s in page_slots(page)} - set(got)))
    return got


def put(cache: RadixCache, tokens: list[int], *, state: bool = False):
    """Insert tokens on fresh slots (a request that computed all of them), and free those the
    tree did not take; returns (node, slots, state)."""
    slots = fresh(cache.kv, 0, len(tokens))
    s = cache.states.alloc(1)[0] if state else None
    node = cache.insert(tokens, slots, s)
    kept = cache.path_slots(node)
    cache.kv.free([mine for mine, k in zip(slots, kept) if mine != k])
    cache.check()
    return node, slots, s


def contents(cache: RadixCache) -> tuple[dict[tuple, int], dict[tuple, int]]:
    """What the tree caches, flattened: prefix -> slot of its last token, prefix -> state."""
    slots, states = {}, {}
    stack = [((), cache.root)]
    while stack:
        prefix, node = stack.pop()
        for child in node.children.values():
            p = prefix
            for t, s in zip(child.key, child.slots):
                p += (t,)
                slots[p] = s
            if child.state is not None:
                states[p] = child.state
            stack.append((p, child))
    return slots, states


# -- matching and splitting -------------------------------------------------------------------

def test_match_on_empty_tree_is_the_root():
    cache = make_cache(states=4)
    for need in (False, True):
        m = cache.match([1, 2, 3], need_state=need)
        assert (m.node, m.length, m.slots, m.state) == (cache.root, 0, [], None)
    assert cache.match([]).length == 0
    cache.check()


def test_exact_and_longer_queries_return_the_inserted_slots_in_order():
    cache = make_cache()
    node, slots, _ = put(cache, [5, 6, 7])
    for query in ([5, 6, 7], [5, 6, 7, 8, 9]):
        m = cache.match(query)
        assert (m.node, m.length, m.slots) == (node, 3, slots)
    assert cache.cached_tokens == 3
    cache.check()


def test_cached_length_is_the_match_length_and_changes_nothing():
    """The scheduler peeks at queued prompts with it every step: no split, no touch."""
    cache = make_cache()
    put(cache, [5, 6, 7, 8])
    put(cache, [5, 6, 9])
    before = (contents(cache), [n.stamp for n in cache.root.children.values()])
    for query, length in (([5, 6, 7], 3), ([5, 6, 7, 8, 1], 4), ([5, 6, 9, 9], 3),
                          ([5, 1], 1), ([2], 0), ([], 0)):
        assert cache.cached_length(query) == length == make_copy_match(query)
    assert (contents(cache), [n.stamp for n in cache.root.children.values()]) == before
    cache.check()


def make_copy_match(query: list[int]) -> int:
    """match()'s length for query, on a tree of its own (match splits and touches)."""
    other = make_cache()
    put(other, [5, 6, 7, 8])
    put(other, [5, 6, 9])
    return other.match(query).length


def test_shorter_query_splits_and_the_original_node_stays_below():
    cache = make_cache()
    node, slots, _ = put(cache, [1, 2, 3, 4])
    m = cache.match([1, 2])
    cache.check()
    assert (m.length, m.slots) == (2, slots[:2])
    assert m.node is not node and node.parent is m.node
    assert (m.node.key, node.key, node.slots) == ([1, 2], [3, 4], slots[2:])
    full = cache.match([1, 2, 3, 4])
    assert (full.node, full.slots) == (node, slots)
    assert cache.cached_tokens == 4


def test_diverging_query_splits_at_the_divergence():
    cache = make_cache()
    _, slots, _ = put(cache, [1, 2, 3, 4])
    m = cache.match([1, 2, 9, 9])
    assert (m.length, m.slots, m.node.key) == (2, slots[:2], [1, 2])
    node, other, _ = put(cache, [1, 2, 9, 9])
    assert sorted(m.node.children) == [3, 9]
    assert cache.match([1, 2, 9, 9]).slots == slots[:2] + other[2:]
    assert cache.kv.owned == set(slots) | set(other[2:])
    assert cache.cached_pages == 2


def test_inserting_a_prefix_of_a_key_splits_it():
    cache = make_cache(states=4)
    low, _, s_low = put(cache, [1, 2, 3, 4], state=True)
    up, _, s_up = put(cache, [1, 2], state=True)
    assert (up.key, up.state, low.key, low.state) == ([1, 2], s_up, [3, 4], s_low)
    assert low.parent is up
    assert cache.states.available == 2


# -- duplicates -------------------------------------------------------------------------------

def test_a_duplicate_insert_takes_none_of_the_callers_slots():
    """The caller reads its own copy through its page table until it frees it."""
    cache = make_cache()
    node, kept, _ = put(cache, [1, 2, 3])
    dup = fresh(cache.kv, 0, 3)
    again = cache.insert([1, 2, 3], dup)
    assert again is node and cache.path_slots(node) == kept
    assert cache.kv.owned == set(kept) | set(dup)  # the tree freed nothing of the caller's
    cache.kv.free(dup)
    cache.check()
    assert cache.kv.owned == set(kept) and cache.cached_tokens == 3


def test_partial_overlap_keeps_the_trees_slots_and_takes_the_callers_new_ones():
    cache = make_cache()
    _, a, _ = put(cache, [1, 2, 3, 4])
    b = fresh(cache.kv, 0, 5)
    node = cache.insert([1, 2, 5, 6, 7], b)
    assert cache.path_slots(node) == a[:2] + b[2:]
    cache.kv.free(b[:2])  # the caller's copies of what the tree had
    cache.check()
    assert cache.kv.owned == set(a) | set(b[2:]) and cache.cached_tokens == 7


def test_passing_back_matched_slots_frees_nothing():
    cache = make_cache()
    _, a, _ = put(cache, [1, 2, 3])
    m = cache.match([1, 2, 3, 4, 5])
    new = fresh(cache.kv, 3, 5)
    node = cache.insert([1, 2, 3, 4, 5], m.slots + new)
    cache.check()
    assert cache.kv.owned == set(a) | set(new)
    assert cache.path_slots(node) == a + new


# -- locks and eviction -----------------------------------------------------------------------

def test_lock_counts_run_up_the_path_and_unlock_below_zero_fails():
    cache = make_cache()
    put(cache, [1, 2, 3])
    leaf, _, _ = put(cache, [1, 2, 4, 5])
    upper = leaf.parent
    cache.lock(leaf)
    cache.lock(leaf)
    cache.check()
    assert (leaf.lock, upper.lock, cache.root.lock) == (2, 2, 2)
    assert cache.evictable_tokens == 1  # only the [3] leaf
    cache.unlock(leaf)
    cache.unlock(leaf)
    assert cache.evictable_tokens == 5 and cache.root.lock == 0
    with pytest.raises(AssertionError):
        cache.unlock(leaf)


def test_splitting_a_locked_node_keeps_its_locks():
    cache = make_cache()
    node, slots, _ = put(cache, [1, 2, 3, 4])
    cache.lock(node)
    upper = cache.match([1, 2]).node  # splits the locked node
    cache.check()
    assert upper.lock == node.lock == 1 and cache.evictable_tokens == 0
    assert cache.evict(4) == 0
    cache.unlock(node)  # the caller's handle still unlocks the whole path
    cache.check()
    assert upper.lock == 0 and cache.evict(4) == 4


def test_eviction_spares_locked_nodes_and_their_ancestors():
    cache = make_cache()
    _, a, _ = put(cache, [1, 2, 3])
    leaf, b, _ = put(cache, [1, 2, 4, 5])
    cache.lock(leaf)
    assert cache.evict(100) == 1  # what it could: the unlocked [3]
    cache.check()
    assert cache.kv.owned == set(a[:2]) | set(b[2:])
    assert cache.match([1, 2, 4, 5]).length == 4
    cache.unlock(leaf)
    assert cache.evict(100) == 4 and cache.cached_tokens == 0
    assert cache.kv.pages_free == cache.kv.pages_total and cache.cached_pages == 0


@pytest.mark.parametrize("touch", [None, 0, 1])
def test_eviction_goes_least_recently_used_first(touch):
    cache = make_cache()
    seqs = [[1, 1], [2, 2], [3, 3]]
    for s in seqs:
        put(cache, s)
    order = [0, 1, 2]
    if touch is not None:
        cache.match(seqs[touch] + [9])  # a longer query still touches the matched path
        order.remove(touch)
        order.append(touch)
    gone = []
    for _ in seqs:
        assert cache.evict(1) == 2
        cached = contents(cache)[0]  # not match(): probing would touch what it finds
        gone += [i for i, s in enumerate(seqs) if tuple(s) not in cached and i not in gone]
    assert gone == order


def test_eviction_cascades_to_parents_that_become_leaves():
    cache = make_cache()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    assert cache.evict(2) == 2  # both leaves; the shared [1, 2] stays
    assert cache.cached_tokens == 2 and cache.match([1, 2, 3]).length == 2
    cache.check()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])
    assert cache.evict(3) == 4  # leaves were not enough: the parent went next
    assert cache.cached_tokens == 0 and cache.kv.pages_free == cache.kv.pages_total
    assert cache.root.children == {}
    cache.check()


def test_evicting_for_pages_goes_on_until_a_page_is_free():
    cache = make_cache(pages=2)
    b = fresh(cache.kv, 0, 6)  # a request's page: it caches 3 positions and runs on
    cache.insert([4, 5, 6], b[:3])
    _, a, _ = put(cache, [1, 2, 3])
    assert cache.kv.pages_free == 0 and cache.cached_pages == 2
    # The least recently used leaf is on the request's page: evicting it frees no page.
    assert cache.evict_pages(1) == 6
    assert cache.kv.pages_free == 1 and cache.kv.owned == set(b[3:])
    assert cache.cached_tokens == 0 and cache.cached_pages == 0
    cache.check()


def test_locking_an_evicted_node_fails():
    cache = make_cache()
    node, _, _ = put(cache, [1, 2])
    cache.evict(2)
    with pytest.raises(AssertionError):
        cache.lock(node)


# -- state slots ------------------------------------------------------------------------------

def test_need_state_backs_off_to_the_deepest_node_with_state():
    cache = make_cache(states=4)
    mid, _, s = put(cache, [1, 2, 3], state=True)
    put(cache, [1, 2, 3, 4, 5])  # no state at its end
    m = cache.match([1, 2, 3, 4, 5, 6], need_state=True)
    assert (m.node, m.length, m.state) == (mid, 3, s)
    assert m.slots == cache.match([1, 2, 3]).slots
    assert cache.match([1, 2, 3, 4, 5]).length == 5  # without need_state: the longest


def test_need_state_never_splits_and_split_keeps_the_state_below():
    cache = make_cache(states=4)
    node, slots, s = put(cache, [1, 2, 3, 4], state=True)
    m = cache.match([1, 2, 3], need_state=True)
    assert (m.node, m.length, m.state) == (cache.root, 0, None)
    assert cache.root.children[1] is node  # not split
    half = cache.match([1, 2])
    assert half.node.state is None and node.state == s and node.parent is half.node
    assert cache.match([1, 2], need_state=True).length == 0
    m = cache.match([1, 2, 3, 4], need_state=True)
    assert (m.node, m.length, m.slots, m.state) == (node, 4, slots, s)
    cache.check()


def test_duplicate_state_is_freed_and_eviction_frees_states():
    cache = make_cache(states=4)
    node, _, s = put(cache, [1, 2], state=True)
    again, _, s2 = put(cache, [1, 2], state=True)
    assert again is node and node.state == s and cache.states.owned == {s}
    cache.insert([], [], cache.states.alloc(1)[0])  # the empty prefix keeps no state
    assert cache.states.owned == {s}
    assert cache.evict(2) == 2
    assert cache.states.available == 4 and cache.kv.pages_free == cache.kv.pages_total
    cache.check()


def test_evict_states_frees_unlocked_lru_states_and_keeps_kv():
    cache = make_cache(states=4)
    a, _, sa = put(cache, [1, 1], state=True)
    b, _, sb = put(cache, [2, 2], state=True)
    c, _, sc = put(cache, [3, 3], state=True)
    cache.lock(a)  # oldest, but locked: a copy from its state may be queued
    cache.match([2, 2])  # b is now newer than c
    assert cache.evict_states(1) == 1
    assert (a.state, b.state, c.state) == (sa, sb, None)
    assert cache.evict_states(5) == 1 and b.state is None and a.state == sa
    assert cache.states.owned == {sa} and cache.cached_tokens == 6
    assert cache.match([3, 3], need_state=True).length == 0
    cache.check()


# -- the tree against a flat reference model --------------------------------------------------

tokens_st = st.lists(st.integers(1, 3), max_size=8)


class RadixMachine(RuleBasedStateMachine):
    """Reference: `ref` maps every cached prefix (a tuple) to the slot of its last token, and
    `ref_states` maps prefixes to state slots. The pools must own exactly what the tree holds:
    this test holds no slots of its own between rules."""

    def __init__(self):
        super().__init__()
        self.cache = make_cache(pages=3, states=6)
        self.ref: dict[tuple, int] = {}
        self.ref_states: dict[tuple, int] = {}
        self.locks: list[tuple] = []  # (node, prefix it ends at)

    def expected_match(self, tokens, need_state):
        k = 0
        while k < len(tokens) and tuple(tokens[:k + 1]) in self.ref:
            k += 1
        if need_state:
            while k and tuple(tokens[:k]) not in self.ref_states:
                k -= 1
        return k, [self.ref[tuple(tokens[:j + 1])] for j in range(k)]

    @rule(tokens=tokens_st, reuse=st.booleans(), with_state=st.booleans())
    def insert(self, tokens, reuse, with_state):
        c = self.cache  # tokens fit one page: a request's first
        if tokens and not c.kv.pages_free:
            c.evict_pages(1)
            self.ref, self.ref_states = contents(c)
        if tokens and not c.kv.pages_free:
            return
        prefix = c.match(tokens).slots if reuse else []  # a caller passing back its hit
        slots = prefix + fresh(c.kv, len(prefix), len(tokens))
        state = c.states.alloc(1)[0] if with_state and c.states.available else None
        node = c.insert(tokens, slots, state)
        for k, s in enumerate(slots):
            self.ref.setdefault(tuple(tokens[:k + 1]), s)
        if state is not None and tokens:
            self.ref_states.setdefault(tuple(tokens), state)
        kept = c.path_slots(node)
        assert kept == [self.ref[tuple(tokens[:k + 1])] for k in range(len(tokens))]
        c.kv.free([mine for mine, k in zip(slots, kept) if mine != k])  # the caller's copies

    @rule(tokens=tokens_st, need_state=st.booleans())
    def match(self, tokens, need_state):
        length, slots = self.expected_match(tokens, need_state)
        m = self.cache.match(tokens, need_state=need_state)
        assert (m.length, m.slots) == (length, slots)
        assert self.cache.path_slots(m.node) == slots
        assert m.state == self.ref_states.get(tuple(tokens[:length]))

    @rule(tokens=tokens_st, need_state=st.booleans())
    def lock(self, tokens, need_state):
        m = self.cache.match(tokens, need_state=need_state)
        self.cache.lock(m.node)
        self.locks.append((m.node, tuple(tokens[:m.length])))

    @precondition(lambda self: self.locks)
    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        node, _ = self.locks.pop(i % len(self.locks))
        self.cache.unlock(node)

    @rule(n=st.integers(0, 30), pages=st.booleans())
    def evict(self, n, pages):
        c = self.cache
        before = c.evictable_tokens
        if pages:
            n %= c.kv.pages_total + 2
            freed = c.evict_pages(n)
            assert c.kv.pages_free >= n or c.evictable_tokens == 0
        else:
            freed = c.evict(n)
            assert freed >= n or c.evictable_tokens == 0
        assert freed <= before
        after, after_states = contents(c)
        assert after.items() <= self.ref.items() and len(self.ref) - len(after) == freed
        for _, prefix in self.locks:  # a locked node and all its ancestors stay
            assert all(prefix[:k + 1] in after for k in range(len(prefix)))
            assert not prefix or prefix in after_states or prefix not in self.ref_states
        assert after_states.items() <= self.ref_states.items()
        self.ref, self.ref_states = after, after_states

    @rule(n=st.integers(0, 4))
    def evict_states(self, n):
        locked = {p[:k] for _, p in self.locks for k in range(1, len(p) + 1)}
        free_able = [p for p in self.ref_states if p not in locked]
        assert self.cache.evict_states(n) == min(n, len(free_able))
        slots, states = contents(self.cache)
        assert slots == self.ref and locked & self.ref_states.keys() <= states.keys()
        self.ref_states = states

    @invariant()
    def consistent(self):
        c = self.cache
        c.check()
        assert contents(c) == (self.ref, self.ref_states)
        assert c.kv.owned == set(self.ref.values()) and c.cached_tokens == len(self.ref)
        assert c.states.owned == set(self.ref_states.values())
        assert c.root.lock == len(self.locks)

    def teardown(self):
        c = self.cache
        for node, _ in self.locks:
            c.unlock(node)
        assert c.evictable_tokens == c.cached_tokens
        assert c.evict(10**6) == len(self.ref)
        c.check()
        assert c.kv.available == c.kv.capacity and c.states.available == c.states.capacity


RadixMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
test_radix_machine = RadixMachine.TestCase


def test_a_match_tells_how_far_the_tokens_are_cached_without_splitting():
    """Match.reach: where the prompt leaves the tree, states or not (a hybrid prompt's chunk
    ends there, so the next prompt sharing that much resumes at a snapshot)."""
    cache = make_cache(states=4)
    pool = cache.kv
    cache.insert([1, 2, 3, 4, 5], fresh(pool, 0, 5))
    cache.insert([1, 2, 9], fresh(pool, 0, 3))
    nodes = {id(n) for n in _nodes(cache.root)}

    def reach(tokens):
        return cache.match(tokens, need_state=True).reach

    assert reach([1, 2, 3, 7]) == 3  # into the middle of an edge
    assert reach([1, 2, 9, 9]) == 3
    assert reach([1, 2, 3, 4, 5, 6]) == 5
    assert reach([8]) == 0 and reach([]) == 0
    assert {id(n) for n in _nodes(cache.root)} == nodes  # no split
    assert cache.match([1, 2, 3, 7]).reach == 3  # the same without states (it splits there)


def _nodes(node):
    yield node
    for child in node.children.values():
        yield from _nodes(child)


def test_a_state_with_the_head_input_replaces_one_without_and_not_the_other_way():
    cache = make_cache(states=8)
    tokens = [1, 2, 3, 4]
    node, _, plain = put(cache, tokens, state=True)
    assert node.state == plain and not node.head_input
    # The same prompt ends again, its state keeping the head's input: the node takes it.
    keeps = cache.states.alloc(1)[0]
    again = cache.insert(tokens, cache.path_slots(node), keeps, head_input=True)
    assert again is node and node.state == keeps and node.head_input
    assert plain not in cache.states.owned  # the plain snapshot went back to its pool
    # A later plain snapshot or a second one with the head input goes back instead.
    for head_input in (False, True):
        extra = cache.states.alloc(1)[0]
        cache.insert(tokens, cache.path_slots(node), extra, head_input=head_input)
        assert node.state == keeps and extra not in cache.states.owned
    cache.check()
    # A split keeps the state (and the head input) with the lower half, where it belongs.
    put(cache, [1, 2, 9])
    assert node.key == [3, 4] and node.head_input and not node.parent.head_input
    cache.evict_states(1)
    assert node.state is None and not node.head_input
    cache.check()
