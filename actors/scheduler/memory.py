"""The scheduler's memory: KV pages, recurrent-state slots, the radix prefix tree, and the
deferred ops (ops.py) that tell the runner what to do with its own memory (docs/architecture.md,
sections 6 and 8).

One KV pool, addressed by page (protocol.messages.KV_PAGE): the tree and every request's page
table point into it, so a cached prefix is read where it was computed. What a request holds:
- `pages`, its page table (sent to the runner: Op PAGES); the tree's slots of its first
  `tree_len` positions stay alive through `req.lock`, and `held` are the slots it frees itself.
- A prefix hit shares each page of the prefix the tree holds whole, and copies the rest of the
  prefix (a partial last page, or a page mixed from two requests' inserts) into its own pages
  (Op KV_COPY): slots stay where their positions are, slot % KV_PAGE == position % KV_PAGE.
  The tree's pages it copied from stay locked with its prefix while it runs: alone in a full
  pool it ends short of the whole capacity by them, and one they keep from being admitted at
  all computes its prefix instead (admit).
- `state` (hybrid models) is its live recurrent-state slot.

Exact repeats of a hybrid prompt (`head_input`, where the runner supports it): the state after
a prompt is cached with the LM head's input at its last token (ModelLayers.head_input), so a
repeat, a retry or a later choice of `n` takes the whole prompt from the tree and only samples
(the head, no forward); elsewhere a hit leaves the prompt's last token to compute, for its
logits.
"""

from __future__ import annotations

from typing import Any

from actors.scheduler.ops import OpQueue
from actors.scheduler.pools import PagePool, SlotPool, page_slots, pages_for
from actors.scheduler.radix import Match, RadixCache
from actors.scheduler.request import Request
from protocol.messages import KV_PAGE, OpKind


class Memory:
    def __init__(self, kv_slots: int, state_slots: int = 0, prefix: bool = False,
                 share_groups: bool = True, snapshot_interval: int = 0,
                 head_input: bool = False):
        self.kv = PagePool(kv_slots)
        self.states = SlotPool(state_slots) if state_slots else None
        # Hybrid models resume a prefix only where a state snapshot was taken, and snapshots
        # are taken where chunks end: with the prefix cache on, chunks also end at multiples
        # of this interval.
        self.snapshot_interval = snapshot_interval if state_slots and prefix else 0
        self.head_input = head_input and bool(state_slots)
        # Without the prefix cache the tree still carries a group's shared prompt (n > 1) from
        # the sibling that computed it to the others, and is emptied when they let go of it.
        # share_groups False (layers the tree cannot restore): no tree, no KV copy at all.
        self.prefix = prefix
        self.tree = RadixCache(self.kv, self.states) if prefix or share_groups else None
        self.ops = OpQueue()
        # The runner lost its memory (a failed step): the tree points at nothing until every
        # prefix in it has gone (forget).
        self.lost = False
        self.hits = self.hit_tokens = self.inserted_tokens = self.evicted_tokens = 0

    # -- admission ---------------------------------------------------------------------------

    def admit(self, req: Request, row: int, reserve: int) -> bool:
        """Find the request's cached prefix, make room for the rest plus `reserve`, and take
        its pages; False (nothing taken) if memory is short."""
        match = self._lock_match(req)
        if self.states is not None and not self._state_room():
            # The only snapshots left may be on this request's own path: give them up.
            self._unlock(match)
            if self.tree is not None:
                self.tree.evict_states(1)
            if not self.states.available:
                return False
            match = self._lock_match(req)
        if not self._take_pages(req, match, reserve):
            self._unlock(match)
            if match is None or not match.length or not self._alone():
                return False
            # Alone and still short: the tree pages its prefix was to be copied from are
            # locked by its own match. It computes the prefix instead of waiting for ever.
            match = None
            if not self._take_pages(req, None, reserve):
                return False
        cached, prefix = (match.length, match.slots) if match else (0, [])
        req.tree_len, req.lock = cached, match.node if match else None
        req.filled = req.kv_len = cached
        req.chunk_ends = self._chunk_ends(req, match)
        if not req.retractions:
            req.cached = cached
        self.ops.pages(row, 0, req.pages)
        if cached:
            self.hits += 1
            self.hit_tokens += cached
            # Shared pages are the tree's own slots: the rest of the prefix is copied.
            src, dst = [], []
            for tree_slot, mine in zip(prefix, req.slots(0, cached)):
                if tree_slot != mine:
                    src.append(tree_slot)
                    dst.append(mine)
            if src:
                self.ops.kv_copy(src, dst)
        if self.states is not None:
            req.state = self.states.alloc(1)[0]
            if cached:
                self.ops.copy(match.state, req.state)
            else:
                self.ops.clear(req.state)
        return True

    def _take_pages(self, req: Request, match: Match | None, reserve: int) -> bool:
        """The request's page table: the pages of its cached prefix the tree holds whole,
        and its own pages for the rest of its fill, after making room for them and for the
        pages `reserve` more tokens would take (up to the whole pool: alone, a request is
        always admitted, as Scheduler.add checked). False, nothing taken, if short."""
        table = _shared_pages(match.slots if match else [], len(req.fill))
        own = table.count(None)
        reach = min(len(req.fill) + reserve, self.kv.capacity)
        if not self.make_room(own + pages_for(reach) - len(table)):
            return False
        fresh = iter(self.kv.alloc_pages(own))
        req.pages = [page if page is not None else next(fresh) for page in table]
        req.held = {s for page, shared in zip(req.pages, table) if shared is None
                    for s in page_slots(page)}
        return True

    def _alone(self) -> bool:
        """No request holds KV or a lock on the tree."""
        return self.tree.root.lock == 0 and self.kv.held_slots == self.tree.cached_tokens

    def _chunk_ends(self, req: Request, match: Match | None) -> list[int]:
        """Where the request's prefill chunks end so the tree can resume others there. Dense
        models keep every position's KV in the tree anyway: only n > 1 siblings need the cut
        before the prompt's last token, so they compute one token each. A hybrid model
        resumes only at a state snapshot, taken where a chunk ends: there too (an exact
        repeat, a retry, a later n; not needed where the prompt's end is cached with the
        head's input), where the prompt leaves what the tree holds (a shared system prompt
        snapshotted short of its end: the next one resumes there), and at every multiple of
        snapshot_interval."""
        if match is None or not (req.group or self.states is not None):
            return []
        ends = set() if self.head_input else {len(req.fill) - 1}
        if self.states is not None and match.reach < len(req.fill) - 1:
            ends.add(match.reach)  # (at len - 1 only because the match left the last token out)
        if self.snapshot_interval:
            ends.update(range(self.snapshot_interval, len(req.fill), self.snapshot_interval))
        return sorted(end for end in ends if end > match.length)

    def left_to_compute(self, req: Request) -> int:
        """The prompt tokens a queued request would prefill if admitted now: its fill less
        the tree's longest prefix of it (an estimate: admission may back off from there, to a
        state snapshot or short of the last token)."""
        if not self._uses_tree(req):
            return len(req.fill)
        return len(req.fill) - min(self.tree.cached_length(req.fill), len(req.fill) - 1)

    def _uses_tree(self, req: Request) -> bool:
        return self.tree is not None and not self.lost and (self.prefix or bool(req.group))

    def _lock_match(self, req: Request) -> Match | None:
        """The whole fill where it is cached with the head's input; else the longest usable
        prefix short of the last token, which is computed for its logits."""
        if not self._uses_tree(req):
            return None
        match = None
        if req.scoring:
            # The positions to score are computed: their logits are not in the tree. A hit
            # may cover what comes before the first of them.
            cut = max(req.params.prompt_logprobs_from - 1, 0)
            match = self.tree.match(req.fill[:min(cut, len(req.fill) - 1)],
                                    need_state=self.states is not None)
        elif self.head_input:
            # Short of the whole fill it is the deepest snapshot before the last token anyway;
            # only a whole-fill node that cannot sample needs a second walk, to back off.
            match = self.tree.match(req.fill, need_state=True)
            if match.length == len(req.fill) and not match.node.head_input:
                match = None
        if match is None:
            match = self.tree.match(req.fill[:-1], need_state=self.states is not None)
        self.tree.lock(match.node)  # before evicting: the match must survive it
        return match

    def _unlock(self, match: Match | None) -> None:
        if match is not None:
            self.tree.unlock(match.node)

    def make_room(self, pages: int) -> bool:
        """At least this many free KV pages, evicting unlocked cached prefixes (LRU) if
        needed."""
        if self.kv.pages_free < pages and self.tree is not None:
            self.evicted_tokens += self.tree.evict_pages(pages)
        return self.kv.pages_free >= pages

    def grow(self, req: Request, row: int, positions: int) -> None:
        """The request's page table covers this many positions: a decode row that crosses
        into a new page takes one (after make_room) and the runner is told."""
        short = req.pages_short(positions)
        if short:
            new = self.kv.alloc_pages(short)
            self.ops.pages(row, len(req.pages), new)
            req.pages += new
            req.held.update(s for page in new for s in page_slots(page))

    def _state_room(self) -> bool:
        if not self.states.available and self.tree is not None:
            self.tree.evict_states(1)
        return self.states.available > 0

    # -- caching prefixes --------------------------------------------------------------------

    def cache_prompt(self, req: Request, row: int) -> None:
        """Before a request's first decode row is built: its whole fill ran in built steps
        (the last chunk sampled), so the state after it and the head's input at its last
        token are cached for an exact repeat."""
        if self.head_input and req.kv_len == len(req.fill):
            self.cache_prefix(req, row, len(req.fill), OpKind.SNAPSHOT, head_input=True)

    def cache_prefix(self, req: Request, row: int, n: int,
                     state_op: OpKind | None = OpKind.SNAPSHOT, head_input: bool = False) -> None:
        """Hand the first n tokens' KV (and, hybrid, the state after them) to the tree.
        SNAPSHOT (a chunk boundary: the live state is after exactly n tokens when the next
        chunk's batch starts) copies the live state into a new slot; DONATE (the request ended
        after exactly n tokens) gives the live slot itself, no copy; None caches no state.
        head_input: the row's last forward ran position n - 1 and sampled after it, and the
        state keeps the head's input there. The KV stays where it is: the tree takes the
        request's slots of the positions it did not hold yet, and the request keeps reading
        them through its page table (its own copies of the others it frees at release)."""
        if not self._uses_tree(req) or n <= req.tree_len:
            return
        seq = (req.prompt + req.output)[:n]
        state = None
        if self.states is not None and state_op is OpKind.DONATE:
            state = req.state
        elif self.states is not None and state_op is OpKind.SNAPSHOT and self._state_room():
            state = self.states.alloc(1)[0]
        mine = req.slots(0, n)
        node = self.tree.insert(seq, mine, state=state, head_input=head_input)
        kept = self.tree.path_slots(node)
        for p in range(req.tree_len, n):
            if kept[p] == mine[p]:
                req.held.remove(mine[p])
                self.inserted_tokens += 1
        if state is not None and state_op is OpKind.SNAPSHOT and node.state == state:
            self.ops.snapshot(req.state, state, head_input)
        if state is not None and state_op is OpKind.DONATE:
            # The tree kept it, or freed it because it had one already: either way the row
            # no longer owns it.
            self.ops.donate(row, state, head_input)
            req.state = -1
        self.tree.lock(node)
        if req.lock is not None:
            self.tree.unlock(req.lock)
        req.lock, req.tree_len = node, n

    # -- release -----------------------------------------------------------------------------

    def release(self, req: Request, row: int, keep: bool) -> None:
        """No step in flight carries the request: cache what it computed (keep) and give back
        everything else."""
        # A step in flight when the request was aborted may have run on a token that was
        # then dropped: only positions whose tokens are known are cached, and the live state
        # (which has seen that token) is donated only if it matches them exactly.
        known = min(req.kv_len, len(req.prompt) + len(req.output))
        if keep and known:
            # Past its prompt every forward of the row sampled: its last one kept the head's
            # input at position known - 1.
            self.cache_prefix(req, row, known, OpKind.DONATE if known == req.kv_len else None,
                              head_input=self.head_input and not req.prefilling)
        self.kv.free(req.held)
        if req.lock is not None:
            self.tree.unlock(req.lock)
        if req.state >= 0:
            self.states.free([req.state])
        req.pages, req.held, req.tree_len, req.lock, req.state = [], set(), 0, None, -1
        if req.group and self.tree is not None and not self.prefix:
            # No cache across requests: drop what the group let go of.
            self.evicted_tokens += self.tree.evict(self.tree.cached_tokens)
        if self.lost:
            self._evict_all()

    # -- a runner that lost its memory -------------------------------------------------------

    def forget(self) -> None:
        """A step failed and the runner dropped all its memory (actors/model_runner/actor.py,
        reset): no cached prefix is there any more, and the ops not sent yet act on what is
        gone. Unlocked prefixes go now; locked ones as their requests let go of them, and
        until then no prefix is matched or cached."""
        self.ops = OpQueue()
        if self.tree is not None:
            self.lost = True
            self._evict_all()

    def _evict_all(self) -> None:
        self.evicted_tokens += self.tree.evict(self.tree.cached_tokens)
        self.lost = self.tree.cached_tokens > 0

    # -- accounting --------------------------------------------------------------------------

    def leaks(self) -> dict[str, Any]:
        """With no request live: every slot not held by the tree is free, no lock is held."""
        tree_slots, tree_states = set(), set()
        if self.tree is not None:
            for node in self.tree.walk():
                tree_slots.update(node.slots)
                if node.state is not None:
                    tree_states.add(node.state)
        out: dict[str, Any] = {"slots": sorted(self.kv.owned - tree_slots)}
        if self.states is not None:
            out["states"] = sorted(self.states.owned - tree_states)
        if self.tree is not None and self.tree.root.lock:
            out["locks"] = [self.tree.root.lock]
        return out

    def stats(self) -> dict[str, int]:
        """free_slots: the free pages' tokens. pages_used: held by a request or the tree;
        pages_cached: holding a slot of the tree (a page can be both)."""
        tree = self.tree
        return {"free_slots": self.kv.available,
                "cached_tokens": tree.cached_tokens if tree is not None else 0,
                "pages_total": self.kv.pages_total, "pages_free": self.kv.pages_free,
                "pages_used": self.kv.pages_total - self.kv.pages_free,
                "pages_cached": tree.cached_pages if tree is not None else 0,
                "hits": self.hits, "hit_tokens": self.hit_tokens,
                "inserted_tokens": self.inserted_tokens, "evicted_tokens": self.evicted_tokens}


def _shared_pages(prefix: list[int], length: int) -> list[int | None]:
    """A page table for `length` positions whose cached prefix is in the tree's slots
    `prefix`: per page, the tree's page where the prefix fills it with exactly that page's
    slots (read in place), else None (a page of the request's own)."""
    table: list[int | None] = [None] * pages_for(length)
    for i in range(len(prefix) // KV_PAGE):
        first = prefix[i * KV_PAGE]
        if first % KV_PAGE == 0 and prefix[i * KV_PAGE:(i + 1) * KV_PAGE] == list(
                range(first, first + KV_PAGE)):
            table[i] = first // KV_PAGE
    return table
