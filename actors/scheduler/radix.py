"""The radix prefix tree: token prefixes -> KV slot ids, so a prompt that starts with a cached
prefix reuses those slots instead of recomputing them. Pure data: no arrays, no clock.

Token granular: a node's `key` (tokens) and `slots` (one KV slot per token) are aligned lists.
Each slot was written for its position by the request that computed it, so it sits at that
position's offset in its page (slot % KV_PAGE == position % KV_PAGE): a later request reads a
whole page of the path in place, through its page table, and copies only partial ones.
For hybrid models a node may also hold `state`: the recurrent-state slot after its last token.
A prefix is only resumable by a hybrid model where such a snapshot exists (match need_state).
`head_input`: that slot also keeps the LM head's input at the node's last token (a prompt's
end), so a request whose whole fill ends there samples its next token with no forward.

Locks count along the path: lock(node) adds one to node and every ancestor up to the root, so
node.lock == locks held on node's subtree, and lock == 0 means the whole subtree is evictable.
A split keeps the original node object as the LOWER half, so a caller holding a lock on it
still unlocks the right path afterwards.

Costs: match / insert / lock / unlock are O(length of the tokens or path). evict, evict_pages
and evict_states walk the whole tree once and use a heap: O(nodes + k log nodes) per call.
"""

from __future__ import annotations

import heapq
from collections import Counter
from dataclasses import dataclass
from itertools import count
from typing import Callable, Iterator, Sequence

from actors.scheduler.pools import PagePool, SlotPool
from protocol.messages import KV_PAGE


class Node:
    __slots__ = ("key", "slots", "children", "parent", "lock", "state", "head_input", "stamp",
                 "seq")

    def __init__(self, key: list[int], slots: list[int], parent: Node | None, stamp: int, seq: int):
        self.key, self.slots, self.parent = key, slots, parent
        self.children: dict[int, Node] = {}  # keyed by the child's first token
        self.lock = 0
        self.state: int | None = None
        self.head_input = False  # state also keeps the LM head's input at the last token
        self.stamp = stamp  # logical LRU clock of the last match/insert through this node
        self.seq = seq  # creation order: a unique tie-break in the eviction heap

    def __repr__(self) -> str:
        return f"Node(len={len(self.key)}, lock={self.lock}, state={self.state})"


@dataclass(frozen=True, slots=True)
class Match:
    node: Node  # ends exactly at `length` tokens; lock it to keep slots and state alive
    length: int
    slots: list[int]  # KV slots of tokens[:length], in order
    state: int | None  # the node's state slot (None at the root or without one)
    reach: int = 0  # leading tokens cached, usable or not (where the walk left the tree)


class RadixCache:
    def __init__(self, kv: PagePool, states: SlotPool | None = None):
        self.kv, self.states = kv, states
        self._seq = count()
        self._clock = 0
        self.root = Node([], [], None, 0, next(self._seq))
        self._cached = 0  # kv slots held by the tree
        self._evictable = 0  # kv slots in nodes with lock == 0 (their whole subtree is unlocked)
        self._pages: Counter[int] = Counter()  # kv page -> slots of it the tree holds

    @property
    def cached_tokens(self) -> int:
        return self._cached

    @property
    def evictable_tokens(self) -> int:
        return self._evictable

    @property
    def cached_pages(self) -> int:
        """KV pages holding at least one slot of the tree."""
        return len(self._pages)

    # -- lookup and insertion ----------------------------------------------------------------

    def match(self, tokens: Sequence[int], *, need_state: bool = False) -> Match:
        """Longest cached prefix of tokens. need_state backs off to the deepest node on the
        path with a state slot, and never splits: a split's upper half has no state anyway."""
        tokens = list(tokens)
        node, i, path = self.root, 0, [self.root]
        best, best_i, best_len = self.root, 0, 1  # deepest usable node, its length, path depth
        edge = 0  # tokens cached on an edge the walk could not take whole
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            p = _common(child.key, tokens, i)
            if p < len(child.key):
                if need_state:
                    edge = p
                    break
                child = self._split(child, p)
            node, i = child, i + p
            path.append(node)
            if not need_state or node.state is not None:
                best, best_i, best_len = node, i, len(path)
        self._clock += 1
        for n in path[:best_len]:
            n.stamp = self._clock  # touch only what the caller can use
        slots = [s for n in path[1:best_len] for s in n.slots]
        return Match(best, best_i, slots, best.state, i + edge)

    def cached_length(self, tokens: Sequence[int]) -> int:
        """How many leading tokens the tree holds: match's length without its side effects
        (no split, no touch), for ordering a queue by what is left to compute."""
        node, i = self.root, 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            p = _common(child.key, tokens, i)
            i += p
            if p < len(child.key):
                break
            node = child
        return i

    def insert(self, tokens: Sequence[int], slots: Sequence[int], state: int | None = None,
               head_input: bool = False) -> Node:
        """Cache tokens[i] -> slots[i]. Where a token is cached already the tree keeps its own
        slot and the caller keeps (and frees) its copy; the tree takes ownership only of the
        slots it stores, those after the cached prefix (path_slots tells which). Returns the
        node ending exactly at len(tokens); a given state goes there, or back to its pool if
        the node has one already (unless only the given one keeps the head's input: then it
        replaces it)."""
        tokens, slots = list(tokens), list(slots)
        assert len(tokens) == len(slots), f"{len(tokens)} tokens, {len(slots)} slots"
        self._clock += 1
        node, i = self.root, 0
        node.stamp = self._clock
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                child = Node(tokens[i:], slots[i:], node, self._clock, next(self._seq))
                node.children[tokens[i]] = child
                self._cached += len(child.key)
                self._evictable += len(child.key)
                self._pages.update(s // KV_PAGE for s in child.slots)
                node, i = child, len(tokens)
                break
            p = _common(child.key, tokens, i)
            if p < len(child.key):
                child = self._split(child, p)
            node, i = child, i + p
            node.stamp = self._clock
        if state is not None:
            if node is self.root or (node.state is not None
                                     and (node.head_input or not head_input)):
                # The tree keeps its own; the empty prefix needs none (its state is a clear).
                self._states().free([state])
            else:
                if node.state is not None:
                    self._states().free([node.state])
                node.state, node.head_input = state, head_input
        return node

    def path_slots(self, node: Node) -> list[int]:
        """KV slots of the prefix ending at node, in order: after insert(), where they are
        the caller's, the tree took them."""
        parts = []
        while node is not self.root:
            parts.append(node.slots)
            node = node.parent
        return [s for part in reversed(parts) for s in part]

    # -- locks -------------------------------------------------------------------------------

    def lock(self, node: Node) -> None:
        assert node is self.root or node.parent is not None, "lock on an evicted node"
        while node is not None:
            if node.lock == 0:
                self._evictable -= len(node.key)
            node.lock += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            assert node.lock > 0, f"unlock below zero at {node!r}"
            node.lock -= 1
            if node.lock == 0:
                self._evictable += len(node.key)
            node = node.parent

    # -- eviction ----------------------------------------------------------------------------

    def evict(self, n: int) -> int:
        """Free at least n kv slots (if possible) from unlocked leaves, least recently used
        first. Returns the kv slots freed."""
        return self._evict(lambda freed: freed >= n)

    def evict_pages(self, n: int) -> int:
        """Evict as evict() does until the kv pool has n free pages (if possible): a page is
        free only once none of its slots is held, by the tree or by a request. Returns the kv
        slots freed."""
        return self._evict(lambda freed: self.kv.pages_free >= n)

    def _evict(self, done: Callable[[int], bool]) -> int:
        """A parent left an unlocked leaf joins the heap. Its stamp is >= its children's, so
        the order stays LRU."""
        heap = [(x.stamp, x.seq, x) for x in self.walk() if not x.children and x.lock == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and not done(freed):
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            freed += len(leaf.slots)
            self._drop(leaf)
            if parent is not self.root and not parent.children and parent.lock == 0:
                heapq.heappush(heap, (parent.stamp, parent.seq, parent))
        return freed

    def evict_states(self, n: int) -> int:
        """Free at least n state slots (if possible) from unlocked nodes, LRU first, keeping
        their kv: the tokens still route to deeper snapshots, and a stateless leaf is left
        for evict() to reclaim in its LRU turn. Returns the state slots freed."""
        held = sorted((x.stamp, x.seq, x) for x in self.walk() if x.state is not None and x.lock == 0)
        victims = [x for _, _, x in held[:max(n, 0)]]
        for x in victims:
            self._states().free([x.state])
            x.state, x.head_input = None, False
        return len(victims)

    # -- internals ---------------------------------------------------------------------------

    def _split(self, node: Node, p: int) -> Node:
        """Cut node's key at p (0 < p < len). The new UPPER node takes key[:p]; the original
        object stays below with key[p:], its children, its state and its identity (locks)."""
        upper = Node(node.key[:p], node.slots[:p], node.parent, node.stamp, next(self._seq))
        upper.lock = node.lock  # same set of locks covers both halves: totals unchanged
        node.parent.children[node.key[0]] = upper
        node.key, node.slots, node.parent = node.key[p:], node.slots[p:], upper
        upper.children[node.key[0]] = node
        return upper

    def _drop(self, leaf: Node) -> None:
        self.kv.free(leaf.slots)
        for s in leaf.slots:
            page = s // KV_PAGE
            self._pages[page] -= 1
            if not self._pages[page]:
                del self._pages[page]
        if leaf.state is not None:
            self._states().free([leaf.state])
            leaf.state, leaf.head_input = None, False
        del leaf.parent.children[leaf.key[0]]
        self._cached -= len(leaf.slots)
        self._evictable -= len(leaf.slots)
        leaf.parent = None  # detached: lock() refuses it

    def _states(self) -> SlotPool:
        assert self.states is not None, "a state slot given to a tree with no state pool"
        return self.states

    def walk(self) -> Iterator[Node]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def check(self) -> None:
        """Structural invariants; AssertionError names the first one broken."""
        root = self.root
        assert not root.key and not root.slots and root.state is None and root.parent is None
        seen_slots: set[int] = set()
        seen_states: set[int] = set()
        cached = evictable = 0
        for node in [root, *self.walk()]:
            below = 0
            for first, child in node.children.items():
                assert child.key, "empty key below the root"
                assert child.key[0] == first, "child not keyed by its first token"
                assert child.parent is node, "child's parent link broken"
                assert child.stamp <= node.stamp, "child touched more recently than its parent"
                below += child.lock
            assert node.lock >= below, f"lock {node.lock} < children's {below} at {node!r}"
            assert len(node.slots) == len(node.key), "slots not aligned with key"
            for s in node.slots:
                assert s not in seen_slots, f"slot {s} held twice"
                seen_slots.add(s)
            assert node.state is not None or not node.head_input, "head input without a state"
            if node.state is not None:
                assert node.state not in seen_states, f"state {node.state} held twice"
                seen_states.add(node.state)
            cached += len(node.slots)
            evictable += len(node.slots) if node.lock == 0 else 0
        assert cached == self._cached, f"cached_tokens {self._cached}, tree holds {cached}"
        assert evictable == self._evictable, f"evictable {self._evictable}, counted {evictable}"
        assert seen_slots <= self.kv.owned, "the tree holds a kv slot its pool calls free"
        assert self._pages == Counter(s // KV_PAGE for s in seen_slots), "page counts drifted"
        if seen_states:
            assert seen_states <= self._states().owned, "the tree holds a free state slot"


def _common(key: list[int], tokens: list[int], i: int) -> int:
    """Length of the common prefix of key and tokens[i:]. The slice compare runs in C and
    settles the usual full-match case; the loop only finds where a mismatch is."""
    n = min(len(key), len(tokens) - i)
    if key[:n] == tokens[i:i + n]:
        return n
    return next(j for j in range(n) if key[j] != tokens[i + j])
