"""Free lists the scheduler owns. The runner only ever sees the ids."""

from __future__ import annotations


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


class SlotPool:
    """KV slots, token granular: the scheduler's account of the runner's KV memory. A request
    holds one slot per token whose KV a built step writes; slots come back only when no step in
    flight can still write them."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        # Slots never handed out are the range [_fresh, capacity), not a list: a tiny model's
        # pool holds millions of slots, and a list of them cost the scheduler ~36 bytes each
        # (200+ MB at a 40960-token context). Freed slots are reused first, latest first.
        self._fresh = 0
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
