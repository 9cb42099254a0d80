"""The scheduler's memory: KV slots, recurrent-state slots, the radix prefix tree, and the
deferred ops (ops.py) that tell the runner what to do with its own memory (docs/architecture.md,
sections 6 and 8).

What a request holds:
- `slots[:tree_len]` belong to the tree (locked through `req.lock`), `slots[tree_len:]` are its
  own; `state` (hybrid models) is its live recurrent-state slot.

Exact repeats of a hybrid prompt (`head_input`, where the runner supports it): the state after
a prompt is cached with the LM head's input at its last token (ModelLayers.head_input), so a
repeat, a retry or a later choice of `n` takes the whole prompt from the tree and only samples
(the head, no forward); elsewhere a hit leaves the prompt's last token to compute, for its
logits.
"""

from __future__ import annotations

from typing import Any

from actors.scheduler.ops import OpQueue
from actors.scheduler.pools import SlotPool
from actors.scheduler.radix import Match, RadixCache
from actors.scheduler.request import Request
from protocol.messages import OpKind


class Memory:
    def __init__(self, kv_slots: int, state_slots: int = 0, prefix: bool = False,
                 share_groups: bool = True, snapshot_interval: int = 0,
                 head_input: bool = False):
        self.slots = SlotPool(kv_slots)
        self.states = SlotPool(state_slots) if state_slots else None
        # Hybrid models resume a prefix only where a state snapshot was taken, and snapshots
        # are taken where chunks end: with the prefix cache on, chunks also end at multiples
        # of this interval.
        self.snapshot_interval = snapshot_interval if state_slots and prefix else 0
        self.head_input = head_input and bool(state_slots)
        # Without the prefix cache the tree still carries a group's shared prompt (n > 1) from
        # the sibling that computed it to the others, and is emptied when they let go of it.
        # share_groups False (layers the tree cannot restore): no tree, no KV op at all.
        self.prefix = prefix
        self.tree = RadixCache(self.slots, self.states) if prefix or share_groups else None
        self.ops = OpQueue()
        # The runner lost its memory (a failed step): the tree points at nothing until every
        # prefix in it has gone (forget).
        self.lost = False
        self.hits = self.hit_tokens = self.inserted_tokens = self.evicted_tokens = 0

    # -- admission ---------------------------------------------------------------------------

    def admit(self, req: Request, row: int, reserve: int) -> bool:
        """Find the request's cached prefix, make room for the rest plus `reserve`, and take
        its slots; False (nothing taken) if memory is short."""
        match = self._lock_match(req)
        if self.states is not None and not self._state_room():
            # The only snapshots left may be on this request's own path: give them up.
            self._unlock(match)
            if self.tree is not None:
                self.tree.evict_states(1)
            if not self.states.available:
                return False
            match = self._lock_match(req)
        cached = match.length if match else 0
        if not self.make_room(len(req.fill) - cached + reserve):
            self._unlock(match)
            return False
        req.slots = (match.slots if match else []) + self.slots.alloc(len(req.fill) - cached)
        req.tree_len, req.lock = cached, match.node if match else None
        req.filled = req.kv_len = cached
        req.chunk_ends = self._chunk_ends(req, match)
        if not req.retractions:
            req.cached = cached
        if cached:
            self.hits += 1
            self.hit_tokens += cached
            self.ops.kv_load(row, match.slots)
        if self.states is not None:
            req.state = self.states.alloc(1)[0]
            if cached:
                self.ops.copy(match.state, req.state)
            else:
                self.ops.clear(req.state)
        return True

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

    def make_room(self, n: int) -> bool:
        """At least n free KV slots, evicting unlocked cached prefixes (LRU) if needed."""
        short = n - self.slots.available
        if short > 0 and self.tree is not None:
            self.evicted_tokens += self.tree.evict(short)
        return self.slots.available >= n

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
        state keeps the head's input there. KV is saved only where the tree kept our slots."""
        if not self._uses_tree(req) or n <= req.tree_len:
            return
        seq = (req.prompt + req.output)[:n]
        state = None
        if self.states is not None and state_op is OpKind.DONATE:
            state = req.state
        elif self.states is not None and state_op is OpKind.SNAPSHOT and self._state_room():
            state = self.states.alloc(1)[0]
        node = self.tree.insert(seq, req.slots[:n], state=state, head_input=head_input)
        kept = self.tree.path_slots(node)
        start = req.tree_len
        while start < n:  # one save per run of positions whose slots the tree took from us
            if kept[start] != req.slots[start]:
                start += 1
                continue
            end = start
            while end < n and kept[end] == req.slots[end]:
                end += 1
            self.ops.kv_save(row, start, kept[start:end])
            self.inserted_tokens += end - start
            start = end
        req.slots[:n] = kept
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
        own = req.slots[req.tree_len:]  # tree_len is 0 without the prefix cache
        if own:
            self.slots.free(own)
        if req.lock is not None:
            self.tree.unlock(req.lock)
        if req.state >= 0:
            self.states.free([req.state])
        req.slots, req.tree_len, req.lock, req.state = [], 0, None, -1
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
        out: dict[str, Any] = {"slots": sorted(self.slots.owned - tree_slots)}
        if self.states is not None:
            out["states"] = sorted(self.states.owned - tree_states)
        if self.tree is not None and self.tree.root.lock:
            out["locks"] = [self.tree.root.lock]
        return out

    def stats(self) -> dict[str, int]:
        cached = self.tree.cached_tokens if self.tree is not None else 0
        return {"free_slots": self.slots.available, "cached_tokens": cached,
                "hits": self.hits, "hit_tokens": self.hit_tokens,
                "inserted_tokens": self.inserted_tokens, "evicted_tokens": self.evicted_tokens}
