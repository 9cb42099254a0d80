"""The scheduler's KV slot account: lowest slots first, freed slots reused latest first, every
slot owned once, and a pool of millions of slots costing nothing until they are handed out."""

import sys

import pytest

from actors.scheduler.pools import SlotPool


def test_fresh_slots_come_lowest_first_and_freed_ones_are_reused_first():
    pool = SlotPool(10)
    first = pool.alloc(3)
    assert sorted(first) == [0, 1, 2] and pool.available == 7
    pool.free([1, 2])
    got = pool.alloc(3)
    assert sorted(got) == [1, 2, 3] and pool.available == 6
    assert pool.owned == {0, 1, 2, 3}


def test_every_slot_is_handed_out_once_until_freed():
    pool = SlotPool(50)
    held = pool.alloc(20) + pool.alloc(30)
    assert sorted(held) == list(range(50)) and pool.available == 0
    with pytest.raises(AssertionError):
        pool.alloc(1)
    pool.free(held[::2])
    again = pool.alloc(25)
    assert sorted(again) == sorted(held[::2]) and pool.leaked() == list(range(50))
    with pytest.raises(AssertionError):
        pool.free([again[0], again[0]])  # twice: the second is not owned


def test_a_huge_pool_costs_nothing_until_used():
    """A tiny model at a 40960-token context and 256 rows: 10M slots, in a few bytes."""
    pool = SlotPool(10_000_000)
    assert sys.getsizeof(pool._freed) < 100 and pool.available == 10_000_000
    assert sorted(pool.alloc(4)) == [0, 1, 2, 3]
