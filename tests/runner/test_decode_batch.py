"""The decode batch's own layout (actors/model_runner/decode_batch.py): rows that leave become
holes without touching the others' KV, joining rows fill holes, the batched attention of rows
of different lengths equals each row's attention alone, and the positions compact only when
holes are more than half; a step's positions arrays (offsets, page table, mask, write index)
follow the pages. End-to-end token parity through it: test_runner_core.py."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, KVCache

from actors.model_runner.decode_batch import (FIRST_PAGES, PAGE, BatchedKV, BatchedStates,
                                              DecodeBatch, Positions, row_tokens)

HEADS, DIM = 2, 8


def kv_cache(length: int, seed: int) -> KVCache:
    c = KVCache()
    if length:
        k = mx.random.normal((1, HEADS, length, DIM), key=mx.random.key(seed))
        v = mx.random.normal((1, HEADS, length, DIM), key=mx.random.key(seed + 1000))
        c.update_and_fetch(k, v)
    return c


def state_cache(seed: int) -> ArraysCache:
    c = ArraysCache(2)
    c[0] = mx.full((1, 3), float(seed))
    c[1] = mx.full((1, 2, 2), float(-seed))
    return c


def row_kv(batch: DecodeBatch, row: int) -> np.ndarray:
    """The row's keys as the batch holds them, [heads, length, dim], read through its pages."""
    kv, at = batch.caches[0], batch.where[row]
    keys, _ = kv.tokens(at, 0, int(batch.positions.lengths[at]))
    return np.array(keys.transpose(1, 0, 2))


def own_kv(cache: KVCache) -> np.ndarray:
    return np.array(cache.keys[0, :, :cache.offset, :])


def joined(lengths: dict[int, int]) -> tuple[DecodeBatch, dict[int, KVCache]]:
    batch, caches = DecodeBatch(), {}
    for row, n in lengths.items():
        caches[row] = kv_cache(n, seed=row)
        batch.join(row, [caches[row]])
    return batch, caches


def step(batch: DecodeBatch, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """One decode forward's attention layer: new K/V per position, then the batched fetch."""
    n = len(batch)
    batch.inputs(mx.zeros((16,), mx.int32))
    k = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed))
    v = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed + 1))
    keys, values = batch.caches[0].update_and_fetch(k, v)
    batch.advance()
    return k, keys, values


def test_a_row_that_leaves_is_a_hole_and_the_others_are_not_copied():
    batch, caches = joined({1: 5, 2: 300, 3: 7})
    keys = batch.caches[0].keys
    mx.eval(keys)
    long_pages = list(batch.positions.pages[1])
    batch.release([2])  # the long one, in the middle
    assert batch.slots == [1, None, 3]
    assert batch.caches[0].keys is keys  # no filter, no copy: the same buffer
    assert batch.rows == [1, 3]
    assert len(long_pages) == -(-300 // PAGE) and set(long_pages) <= set(batch.positions.free)
    for row in (1, 3):
        np.testing.assert_array_equal(row_kv(batch, row), own_kv(caches[row]))


def test_a_joining_row_fills_the_lowest_hole_and_only_its_own_columns():
    batch, caches = joined({1: 5, 2: 6, 3: 7, 4: 4})
    batch.release([1, 3])
    new = kv_cache(9, seed=50)
    batch.join(7, [new])
    assert batch.where[7] == 0 and batch.slots == [7, 2, None, 4]
    np.testing.assert_array_equal(row_kv(batch, 7), own_kv(new))
    for row in (2, 4):
        np.testing.assert_array_equal(row_kv(batch, row), own_kv(caches[row]))


def test_batched_attention_of_rows_of_different_lengths_equals_each_row_alone():
    batch, caches = joined({1: 3, 2: 40, 3: 1})
    batch.release([2])
    batch.join(5, [kv_cache(17, seed=9)])  # into the hole, shorter than the row it replaces
    caches[5] = kv_cache(17, seed=9)
    rows = (1, 3, 5)
    own = {r: (own_kv(caches[r]), np.array(caches[r].values[0, :, :caches[r].offset, :]))
           for r in rows}
    for s in range(3):
        q = mx.random.normal((len(batch), HEADS, 1, DIM), key=mx.random.key(100 + s))
        n = len(batch)
        batch.inputs(mx.zeros((16,), mx.int32))
        k = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(10 * s))
        v = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(10 * s + 1))
        keys, values = batch.caches[0].update_and_fetch(k, v)
        mask = batch.caches[0].make_mask(1)
        batch.advance()
        out = np.array(mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3,
                                                            mask=mask))
        for r in rows:
            at = batch.where[r]
            ks = np.concatenate([own[r][0], np.array(k[at])], axis=1)  # [heads, len + 1, dim]
            vs = np.concatenate([own[r][1], np.array(v[at])], axis=1)
            own[r] = (ks, vs)
            w = np.einsum("hd,htd->ht", np.array(q[at, :, 0, :]), ks) * 0.3
            w = np.exp(w - w.max(-1, keepdims=True))
            ref = np.einsum("ht,htd->hd", w / w.sum(-1, keepdims=True), vs)
            np.testing.assert_allclose(out[at, :, 0, :], ref, atol=1e-5)


def test_a_parked_row_keeps_its_kv_and_length_while_the_others_decode():
    batch, caches = joined({1: 6, 2: 8})
    batch.keep([2])  # row 1 finished while a step was in flight: parked, not released
    assert batch.rows == [2] and batch.where[1] == 0
    for s in range(3):
        step(batch, seed=s)
    assert batch.positions.lengths[0] == 6 and batch.positions.lengths[1] == 11
    np.testing.assert_array_equal(row_kv(batch, 1), own_kv(caches[1]))
    assert np.array(batch.live_index()).tolist() == [1]


def test_positions_compact_only_when_holes_are_more_than_half():
    batch, caches = joined({r: r + 2 for r in range(1, 7)})
    keys = batch.caches[0].keys
    batch.release([1, 2, 3])  # 3 holes of 6: not more than half
    assert batch.slots == [None, None, None, 4, 5, 6] and batch.caches[0].keys is keys
    batch.release([6])  # trailing: dropped at once; 3 holes of 5 now: compacted
    assert batch.slots == [4, 5]
    assert batch.caches[0].keys is keys  # only the page tables moved
    step(batch, seed=1)  # and the rows decode on from their new positions
    for row in (4, 5):
        np.testing.assert_array_equal(row_kv(batch, row)[:, :-1], own_kv(caches[row]))
    batch.release([4, 5])
    assert len(batch) == 0 and batch.caches is None  # empty: every buffer goes


def test_recurrent_states_follow_the_positions():
    batch = DecodeBatch()
    for row in (1, 2, 3):
        batch.join(row, [state_cache(row)])
    assert isinstance(batch.caches[0], BatchedStates)
    batch.release([2])
    batch.join(9, [state_cache(9)])
    assert np.array(batch.caches[0][0][:, 0]).tolist() == [1.0, 9.0, 3.0]
    batch.release([1, 9])  # two holes of three, then the trailing one goes: compacted to [3]
    assert batch.slots == [3]
    assert np.array(batch.caches[0][1]).ravel().tolist() == [-3.0] * 4


def test_the_pool_holds_the_rows_tokens_not_rows_times_the_longest():
    lengths = {1: 2000, **{r: 20 for r in range(2, 17)}}
    batch, caches = joined(lengths)
    held = sum(-(-n // PAGE) for n in lengths.values())
    assert batch.positions.used - 1 == held  # page 0 is the scratch page
    # 16 rows padded to the longest would be 16 x 2000 tokens; the pool is a power of two
    # of pages at least as large as what the rows hold.
    assert held * PAGE < 16 * 2000 / 5
    assert held <= batch.caches[0].keys.shape[1] < 2 * max(held + 1, FIRST_PAGES)


def test_the_pool_grows_keeping_what_it_holds_and_reuses_freed_pages():
    batch, caches = joined({1: 250, 2: 3})
    kv = batch.caches[0]
    assert isinstance(kv, BatchedKV) and kv.keys.shape[1] == FIRST_PAGES
    for row in range(3, 8):  # more pages than the pool has: it doubles, nothing is lost
        batch.join(row, [kv_cache(200, seed=row)])
        caches[row] = kv_cache(200, seed=row)
    assert kv.keys.shape[1] == 2 * FIRST_PAGES
    for s in range(8):  # row 1 passes a page boundary (256 tokens) while decoding
        step(batch, seed=s)
    for row in range(1, 8):
        length = caches[row].offset
        np.testing.assert_array_equal(row_kv(batch, row)[:, :length], own_kv(caches[row]))
    freed = list(batch.positions.pages[batch.where[3]])
    batch.release([3])
    batch.join(9, [kv_cache(200, seed=9)])  # takes the freed (warm) pages, not new ones
    assert sorted(batch.positions.pages[batch.where[9]]) == sorted(freed)


def test_a_kv_save_reads_any_token_range_through_the_pages():
    batch, caches = joined({1: 37, 2: 5})
    for start, end in ((0, 37), (3, 20), (16, 32), (30, 37)):
        keys, values = row_tokens(batch.caches[0], batch.where[1], start, end)
        own_k, own_v = row_tokens(caches[1], 0, start, end)
        assert keys.shape == (end - start, HEADS, DIM)
        np.testing.assert_array_equal(np.array(keys), np.array(own_k))
        np.testing.assert_array_equal(np.array(values), np.array(own_v))


def test_a_sequence_of_more_than_one_token_is_refused():
    batch, _ = joined({1: 4})
    with pytest.raises(ValueError, match="one token per row"):
        batch.caches[0].make_mask(3)


def _expected(p: Positions, lengths: list[int], live: list[bool], widths: int) -> dict:
    """What a step's arrays must hold, from the pages alone: each live row's token goes to
    slot length % PAGE of its page length // PAGE, it attends to length + 1 keys through a
    table of its pages padded with the scratch page 0; holes and parked rows write into the
    scratch page and attend to one key."""
    rows = []
    for at, (n, ok) in enumerate(zip(lengths, live)):
        pages = p.pages[at] if ok else []
        rows.append((n, ok, pages))
    return {"written": [pages[n // PAGE] * PAGE + n % PAGE if ok else 0 for n, ok, pages in rows],
            "counts": [n + 1 if ok else 1 for n, ok, _ in rows],
            "table": [pages + [0] * (widths - len(pages)) for _, _, pages in rows]}


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 70), st.booleans()), min_size=0, max_size=9),
       round_pages=st.booleans())
def test_a_steps_positions_arrays_follow_the_pages(rows, round_pages):
    p = Positions()
    p.round_pages = round_pages
    p.resize(len(rows))
    for at, (n, ok) in enumerate(rows):
        p.take(at, n)  # the row's tokens so far
        p.lengths[at], p.live[at] = n, ok
    p.prepare()
    lengths, live = [n for n, _ in rows], [ok for _, ok in rows]
    most = max([len(p.pages[at]) for at, ok in enumerate(live) if ok], default=1)
    assert all(len(p.pages[at]) * PAGE > n for at, (n, ok) in enumerate(rows) if ok)
    widths = 1 << (most - 1).bit_length() if round_pages else most
    want = _expected(p, lengths, live, widths)
    assert p.width == widths * PAGE
    assert p.offset.tolist() == lengths and p.keys_per_row.tolist() == want["counts"]
    assert p.keys_per_row.dtype == mx.int32 and p.table.dtype == mx.int32
    assert p.table.shape == (len(rows), widths) and p.table.tolist() == \
        (want["table"] if rows else [])
    assert p.mask.shape == (len(rows), 1, 1, widths * PAGE)
    assert p.mask[:, 0, 0, :].tolist() == [[k < c for k in range(widths * PAGE)]
                                          for c in want["counts"]]
    # The write index of a pool seen flat as [kv_heads x capacity x PAGE, dim].
    per_head = p.capacity * PAGE
    assert p.writes(2).tolist() == [h * per_head + w for w in want["written"] for h in range(2)]
