"""The scheduler's free lists: KV pages (handed out whole, lowest first, never page 0, back on
the free list once none of their slots is held) and recurrent-state slots."""

import sys

import pytest

from actors.scheduler.pools import PagePool, SlotPool, page_slots
from protocol.messages import KV_PAGE


def test_pages_go_lowest_first_and_page_0_never():
    pool = PagePool(5 * KV_PAGE + 3)  # a partial page at the end is not a page
    assert (pool.pages_total, pool.capacity) == (5, 5 * KV_PAGE)
    first = pool.alloc_pages(3)
    assert first == [1, 2, 3] and pool.pages_free == 2
    pool.free(page_slots(2))
    pool.free(page_slots(1))
    # Freed pages come back lowest first, before the ones never handed out.
    assert pool.alloc_pages(3) == [1, 2, 4]
    assert pool.available == KV_PAGE
    with pytest.raises(AssertionError):
        pool.alloc_pages(2)
    assert pool.alloc_pages(1) == [5] and pool.pages_free == 0


def test_every_slot_of_a_page_is_held_until_freed_and_freeing_twice_fails():
    pool = PagePool(2 * KV_PAGE)
    [page] = pool.alloc_pages(1)
    slots = list(page_slots(page))
    assert pool.owned == set(slots) and pool.held_slots == KV_PAGE
    pool.free(slots[:5])
    assert pool.owned == set(slots[5:]) and pool.held_slots == KV_PAGE - 5
    with pytest.raises(AssertionError):
        pool.free([slots[0]])
    with pytest.raises(AssertionError):
        pool.free([(page + 1) * KV_PAGE])  # a page never handed out


def test_a_page_is_free_only_once_none_of_its_slots_is_held():
    pool = PagePool(2 * KV_PAGE)
    [page] = pool.alloc_pages(1)
    slots = list(page_slots(page))
    pool.free(slots[:-1])
    assert pool.pages_free == 1  # one slot keeps the page
    assert pool.alloc_pages(1) != [page]
    pool.free(slots[-1:])
    assert pool.pages_free == 1 and pool.alloc_pages(1) == [page]
    assert pool.leaked() == sorted(set(range(KV_PAGE, 3 * KV_PAGE)))


def test_a_huge_page_pool_costs_nothing_until_used():
    """A tiny model at a 40960-token context and 256 rows: 10M slots, in a few bytes."""
    pool = PagePool(10_000_000)
    assert sys.getsizeof(pool._freed) < 100 and pool.pages_free == 10_000_000 // KV_PAGE
    assert pool.alloc_pages(2) == [1, 2]


def test_state_slots_come_lowest_first_and_freed_ones_are_reused_first():
    pool = SlotPool(10)
    first = pool.alloc(3)
    assert sorted(first) == [0, 1, 2] and pool.available == 7
    pool.free([1, 2])
    got = pool.alloc(3)
    assert sorted(got) == [1, 2, 3] and pool.available == 6
    assert pool.owned == {0, 1, 2, 3}
    with pytest.raises(AssertionError):
        pool.free([0, 0])  # twice: the second is not owned
