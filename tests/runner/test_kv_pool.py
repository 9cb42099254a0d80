"""The runner's KV pool of record (actors/model_runner/storage.py): slots in segments that are
opened as slot ids reach them, never grown by copying; saves and loads of slots in any order and
across segments give back what was saved."""

import mlx.core as mx
import numpy as np
import pytest

from actors.model_runner import storage
from actors.model_runner.storage import KvPool


def tokens(n: int, seed: int) -> mx.array:
    return mx.random.normal((n, 2, 8), key=mx.random.key(seed))


def test_slots_in_any_order_across_segments_load_as_saved(monkeypatch):
    monkeypatch.setattr(storage, "SEGMENT", 16)
    pool = KvPool([0], capacity=100)
    slots = [3, 40, 17, 15, 16, 90, 0]  # four segments, out of order
    keys, values = tokens(len(slots), 1), tokens(len(slots), 2)
    pool.save(0, pool.locate(slots), keys, values)
    assert len(pool.keys[0]) == 90 // 16 + 1  # segments up to the highest slot, no more
    first = pool.keys[0][0]
    pool.save(0, pool.locate([5, 6]), tokens(2, 3), tokens(2, 4))  # in place: not replaced
    assert pool.keys[0][0] is first
    got_k, got_v = pool.load(0, pool.locate(slots))
    np.testing.assert_array_equal(np.array(got_k), np.array(keys))
    np.testing.assert_array_equal(np.array(got_v), np.array(values))
    got_k, _ = pool.load(0, pool.locate([16, 17]))  # one segment: one gather
    np.testing.assert_array_equal(np.array(got_k), np.array(keys[mx.array([4, 2])]))


def test_a_slot_past_the_capacity_is_refused():
    pool = KvPool([0], capacity=10)
    with pytest.raises(ValueError, match="beyond the pool's capacity 10"):
        pool.locate([2, 10])
