"""Which data-parallel replica (scheduler.dp) runs a request: the one whose prefix cache most
likely holds the longest prefix of its prompt, else the least loaded. Pure: no sockets, no
clock.

The tokenizer cannot see the schedulers' radix trees, so it keeps an approximate index of what
it sent where, as sglang's cache-aware router does with a tree of the prompts it routed: here
the prompt's token ids cut into blocks of BLOCK, each block prefix hashed (chained, so a hash
names the whole prefix up to it) and mapped to the replica that last got it, least recently
used entries dropped past a capacity. A prefix that a replica's cache evicted meanwhile costs
one prefill there, as it would anywhere.

A cache hit only wins while that replica is not much busier than the least loaded one (open
requests counted here, from routing to the terminal reply): a popular system prompt must not
pile every request onto one replica. The n choices of one request (a `group`) stay together,
so they share the prompt's prefill.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

BLOCK = 16  # tokens per hashed block
CAPACITY = 1 << 18  # block prefixes remembered over all replicas (~30 MB)


@dataclass
class Route:
    replica: int
    matched: int  # prompt tokens the chosen replica is believed to hold cached
    reason: str  # "prefix", "group", "session" or "load"


@dataclass
class Router:
    replicas: int
    slack: int = 8  # a cache hit may go to a replica this many open requests busier
    min_match: int = 2 * BLOCK  # and must cover at least this many tokens
    capacity: int = CAPACITY
    load: list[int] = field(init=False)  # open requests per replica
    routed: list[int] = field(init=False)  # requests sent to each replica, ever
    index: OrderedDict[int, int] = field(init=False, default_factory=OrderedDict)
    groups: dict[str, list[int]] = field(init=False, default_factory=dict)  # -> [replica, open]
    sessions: OrderedDict[str, int] = field(init=False, default_factory=OrderedDict)
    session_capacity: int = 1 << 16  # sessions remembered, least recently used dropped
    _next: int = field(init=False, default=0)  # where ties among the least loaded start

    def __post_init__(self) -> None:
        self.load = [0] * self.replicas
        self.routed = [0] * self.replicas

    def route(self, ids: list[int], group: str = "", session: str = "") -> Route:
        """Choose a replica for a prompt and count it open there until done(). A session's
        requests (an agent's turns) go where its first went, whatever the load: its prefix
        cache holds the conversation so far."""
        if self.replicas > 1 and session in self.sessions:
            chosen = Route(self.sessions[session], 0, "session")
            self.sessions.move_to_end(session)
        else:
            chosen = self._choose(ids, group)
            if self.replicas > 1 and session:
                self.sessions[session] = chosen.replica
                while len(self.sessions) > self.session_capacity:
                    self.sessions.popitem(last=False)
        self.load[chosen.replica] += 1
        self.routed[chosen.replica] += 1
        return chosen

    def _choose(self, ids: list[int], group: str) -> Route:
        if self.replicas == 1:  # nothing to choose: no hashing, no index
            return Route(0, 0, "load")
        if group in self.groups:
            entry = self.groups[group]
            entry[1] += 1
            return Route(entry[0], 0, "group")
        hashes = _prefix_hashes(ids)
        hit, matched = self._longest(hashes)
        least = self._least_loaded()
        if hit is not None and matched >= self.min_match and \
                self.load[hit] <= self.load[least] + self.slack:
            chosen = Route(hit, matched, "prefix")
        else:
            chosen = Route(least, 0, "load")
            self._next = (least + 1) % self.replicas
        self._remember(hashes, chosen.replica)
        if group:
            self.groups[group] = [chosen.replica, 1]
        return chosen

    def done(self, replica: int, group: str = "") -> None:
        """A request routed to `replica` got its terminal reply."""
        self.load[replica] = max(0, self.load[replica] - 1)
        entry = self.groups.get(group) if group else None
        if entry is not None:
            entry[1] -= 1
            if entry[1] <= 0:
                del self.groups[group]

    def _longest(self, hashes: list[int]) -> tuple[int | None, int]:
        for k in range(len(hashes) - 1, -1, -1):  # longest first
            replica = self.index.get(hashes[k])
            if replica is not None:
                return replica, (k + 1) * BLOCK
        return None, 0

    def _least_loaded(self) -> int:
        n = self.replicas
        return min(((self._next + i) % n for i in range(n)), key=lambda r: self.load[r])

    def _remember(self, hashes: list[int], replica: int) -> None:
        for h in hashes:
            self.index[h] = replica
            self.index.move_to_end(h)
        while len(self.index) > self.capacity:
            self.index.popitem(last=False)


def _prefix_hashes(ids: list[int]) -> list[int]:
    """One hash per whole block of ids, each covering every block before it."""
    hashes, h = [], 0
    for start in range(0, len(ids) - BLOCK + 1, BLOCK):
        h = hash((h, *ids[start:start + BLOCK]))
        hashes.append(h)
    return hashes
