"""Free lists the scheduler owns. The runner only ever sees the ids."""

from __future__ import annotations

import heapq
from typing import Iterable

from protocol.messages import KV_PAGE


class RowPool:
    """Request-pool rows: one per live request, from admission until every step that
    references it has returned. Row 0 is padding and never handed out."""

    def __init__(self, size: int):
        self.size = size
        # Pop from the end: low rows first, so a quiet server reuses the same few rows.
        self._free = list(range(size, 0, -1))
        self._owned: set[int] = set()

    def alloc(self) -> int | None:
        if not self._free:
            return None
        row = self._free.pop()
        self._owned.add(row)
        return row

    def free(self, row: int) -> None:
        if row not in self._owned:
            raise AssertionError(f"row {row} freed but not owned")
        self._owned.remove(row)
        self._free.append(row)

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(self._owned)

    def leaked(self) -> list[int]:
        """Rows not on the free list: called when the scheduler believes it is idle."""
        return sorted(self._owned)


def pages_for(tokens: int) -> int:
    """Pages that hold this many positions from position 0."""
    return -(-tokens // KV_PAGE)


def page_slots(page: int) -> range:
    """The KV slot ids of one page, in position order."""
    return range(page * KV_PAGE, (page + 1) * KV_PAGE)


FULL = (1 << KV_PAGE) - 1  # every slot of a page held


class PagePool:
    """The runner's one KV pool, as the scheduler accounts for it: pages of KV_PAGE token slots
    (slot s is token s % KV_PAGE of page s // KV_PAGE). Pages are handed out whole and come
    back slot by slot: a request's slots go to the radix tree one by one, the rest at its
    release, and a page is free again once none of its slots is held. Slots come back only
    when no step in flight can still write them.

    Page 0 is the runner's scratch page: never handed out. The lowest free page goes first,
    because the runner's pool grows to the highest page id in use."""

    def __init__(self, capacity: int):
        self.pages_total = capacity // KV_PAGE  # pages 1..pages_total
        self.capacity = self.pages_total * KV_PAGE
        # Pages never handed out are the range [_fresh, pages_total], not a list: a tiny
        # model's pool holds hundreds of thousands of pages. Every freed page is below
        # _fresh, so the heap's top, when there is one, is the lowest free page.
        self._fresh = 1
        self._freed: list[int] = []
        self._held: dict[int, int] = {}  # page -> bit j set while slot j of it is held
        self.held_slots = 0  # over all pages

    @property
    def pages_free(self) -> int:
        return len(self._freed) + self.pages_total + 1 - self._fresh

    @property
    def available(self) -> int:
        """Free tokens, counted in whole free pages."""
        return self.pages_free * KV_PAGE

    def alloc_pages(self, n: int) -> list[int]:
        if n > self.pages_free:
            raise AssertionError(f"{n} pages asked, {self.pages_free} free")
        got = [heapq.heappop(self._freed) for _ in range(min(n, len(self._freed)))]
        fresh = n - len(got)
        got += range(self._fresh, self._fresh + fresh)
        self._fresh += fresh
        for page in got:
            self._held[page] = FULL
        self.held_slots += n * KV_PAGE
        return got

    def free(self, slots: Iterable[int]) -> None:
        for s in slots:
            page, bit = divmod(s, KV_PAGE)
            mask = self._held.get(page, 0)
            if not mask >> bit & 1:
                raise AssertionError(f"slot {s} freed but not held")
            mask &= ~(1 << bit)
            self.held_slots -= 1
            if mask:
                self._held[page] = mask
            else:
                del self._held[page]
                heapq.heappush(self._freed, page)

    @property
    def owned(self) -> frozenset[int]:
        """Every slot held (a page partly given back holds only what is left of it)."""
        return frozenset(page * KV_PAGE + j for page, mask in self._held.items()
                         for j in range(KV_PAGE) if mask >> j & 1)

    def leaked(self) -> list[int]:
        return sorted(self.owned)


class SlotPool:
    """Recurrent-state slots: one per live request, and one per radix node that keeps a
    snapshot. Freed slots are reused first, latest first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._fresh = 0  # slots never handed out are [_fresh, capacity)
        self._freed: list[int] = []
        self._owned: set[int] = set()

    @property
    def available(self) -> int:
        return len(self._freed) + self.capacity - self._fresh

    def alloc(self, n: int) -> list[int]:
        if n > self.available:
            raise AssertionError(f"{n} slots asked, {self.available} free")
        if n == 0:
            return []
        reused = min(n, len(self._freed))
        fresh = n - reused
        got = list(range(self._fresh + fresh - 1, self._fresh - 1, -1))
        if reused:
            got += self._freed[-reused:]
            del self._freed[-reused:]
        self._fresh += fresh
        self._owned.update(got)
        return got

    def free(self, slots: list[int]) -> None:
        for s in slots:
            if s not in self._owned:
                raise AssertionError(f"slot {s} freed but not owned")
            self._owned.remove(s)
        self._freed.extend(slots)

    @property
    def owned(self) -> frozenset[int]:
        return frozenset(self._owned)

    def leaked(self) -> list[int]:
        return sorted(self._owned)
