"""The decode batch's own layout (actors/model_runner/decode_batch.py): rows that leave become
holes without touching anyone's KV, joining rows fill holes, the batched attention of rows of
different lengths (and rows sharing a prefix's pages) equals each row's attention alone, and
the positions compact only when holes are more than half; the batch reads and writes the one
pool (kv_pages.py) through the scheduler's page tables and never allocates a page: a row
without a page for its next token is refused, a table extended in place is read on the next
step. A step's positions arrays (offsets, page table, mask, write index) follow the pages.
End-to-end token parity through it: test_runner_core.py."""

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import ArraysCache, KVCache

from actors.model_runner.decode_batch import (BatchedKV, BatchedStates, DecodeBatch, Positions,
                                              standalone)
from actors.model_runner.kv_pages import PAGE, KvPages, PoolFull, gather, slots_of

HEADS, DIM = 2, 8


def kv_cache(length: int, seed: int) -> KVCache:
    c = KVCache()
    k = mx.random.normal((1, HEADS, length, DIM), key=mx.random.key(seed))
    v = mx.random.normal((1, HEADS, length, DIM), key=mx.random.key(seed + 1000))
    c.update_and_fetch(k, v)
    return c


def state_cache(seed: int) -> ArraysCache:
    c = ArraysCache(2)
    c[0] = mx.full((1, 3), float(seed))
    c[1] = mx.full((1, 2, 2), float(-seed))
    return c


def make_store(limit: int | None = None) -> KvPages:
    """The one pool of a one-layer model, opened as the runner opens it."""
    store = KvPages([0], limit)
    store.open([kv_cache(1, seed=0)])
    return store


def row_kv(batch: DecodeBatch, row: int) -> np.ndarray:
    """The row's keys as the batch holds them, [heads, length, dim], read through its pages."""
    at = batch.where[row]
    table = mx.array([batch.positions.pages[at]], dtype=mx.int32)
    keys = gather(batch.positions.store.keys[0], table)[0]
    return np.array(keys[:, :int(batch.positions.lengths[at])])


def own_kv(cache: KVCache) -> np.ndarray:
    return np.array(cache.keys[0, :, :cache.offset, :])


def joined(lengths: dict[int, int]) -> tuple[DecodeBatch, dict[int, KVCache]]:
    """Rows copied from plain mlx-lm caches into pages of their own (join_copy)."""
    batch, caches = DecodeBatch(make_store()), {}
    for row, n in lengths.items():
        caches[row] = kv_cache(n, seed=row)
        batch.join_copy(row, [caches[row]])
    return batch, caches


def join_at(batch: DecodeBatch, row: int, cache: KVCache, pages: list[int]) -> None:
    """A row as the runner joins it: its prompt's KV already written into the scheduler's
    pages (as its chunks write it), then the table handed over."""
    store = batch.positions.store
    store.write(0, store.index(slots_of(pages, 0, cache.offset), HEADS),
                cache.keys[0, :, :cache.offset].transpose(1, 0, 2)[:, :, None],
                cache.values[0, :, :cache.offset].transpose(1, 0, 2)[:, :, None])
    batch.join(row, [cache], pages)


def step(batch: DecodeBatch, seed: int) -> tuple[mx.array, mx.array, mx.array]:
    """One decode forward's attention layer: new K/V per position, then the batched fetch."""
    n = len(batch)
    batch.inputs(mx.zeros((16,), mx.int32))
    k = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed))
    v = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed + 1))
    keys, values = batch.caches[0].update_and_fetch(k, v)
    batch.advance()
    return k, keys, values


def pool(batch: DecodeBatch) -> tuple[np.ndarray, np.ndarray]:
    store = batch.positions.store
    return np.array(store.keys[0]), np.array(store.values[0])


def test_a_row_that_leaves_is_a_hole_and_nothing_is_copied_or_cleared():
    batch, caches = joined({1: 5, 2: 300, 3: 7})
    store = batch.positions.store
    mx.eval(store.arrays())
    keys, before = store.keys[0], pool(batch)
    batch.release([2])  # the long one, in the middle
    assert batch.slots == [1, None, 3] and batch.rows == [1, 3]
    assert batch.positions.pages[1] == [] and batch.positions.lengths[1] == 0
    assert store.keys[0] is keys and batch.caches[0].keys is keys  # the same buffer
    for was, now in zip(before, pool(batch)):  # its pages too: the scheduler frees them
        np.testing.assert_array_equal(now, was)
    for row in (1, 3):
        np.testing.assert_array_equal(row_kv(batch, row), own_kv(caches[row]))


def test_a_joining_row_fills_the_lowest_hole_and_only_its_own_pages():
    batch, caches = joined({1: 5, 2: 6, 3: 7, 4: 4})
    batch.release([1, 3])
    new = kv_cache(9, seed=50)
    batch.join_copy(7, [new])
    assert batch.where[7] == 0 and batch.slots == [7, 2, None, 4]
    np.testing.assert_array_equal(row_kv(batch, 7), own_kv(new))
    for row in (2, 4):
        np.testing.assert_array_equal(row_kv(batch, row), own_kv(caches[row]))


def test_a_row_joins_with_the_schedulers_page_table_itself():
    batch = DecodeBatch(make_store())
    pages = [9, 4]
    join_at(batch, 1, kv_cache(20, seed=1), pages)
    assert batch.positions.pages[0] is pages  # the list the runner's PAGES ops extend
    assert batch.positions.lengths[0] == 20
    np.testing.assert_array_equal(row_kv(batch, 1), own_kv(kv_cache(20, seed=1)))


def reference(q: np.ndarray, keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """One row's attention alone: q [heads, dim] over [heads, tokens, dim], scale 0.3."""
    w = np.einsum("hd,htd->ht", q, keys) * 0.3
    w = np.exp(w - w.max(-1, keepdims=True))
    return np.einsum("ht,htd->hd", w / w.sum(-1, keepdims=True), values)


def check_steps(batch: DecodeBatch, own: dict, steps: int, seed: int) -> None:
    """`steps` decode steps of the batch's attention, each row's output against its attention
    alone over `own[row]` (its keys and values so far, [heads, tokens, dim]), which grow."""
    for s in range(steps):
        n = len(batch)
        q = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed + 100 + s))
        batch.inputs(mx.zeros((16,), mx.int32))
        k = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed + 10 * s))
        v = mx.random.normal((n, HEADS, 1, DIM), key=mx.random.key(seed + 10 * s + 1))
        keys, values = batch.caches[0].update_and_fetch(k, v)
        mask = batch.caches[0].make_mask(1)
        batch.advance()
        out = np.array(mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.3,
                                                            mask=mask))
        for r in batch.rows:
            at = batch.where[r]
            ks = np.concatenate([own[r][0], np.array(k[at])], axis=1)  # [heads, len + 1, dim]
            vs = np.concatenate([own[r][1], np.array(v[at])], axis=1)
            own[r] = (ks, vs)
            want = reference(np.array(q[at, :, 0, :]), ks, vs)
            np.testing.assert_allclose(out[at, :, 0, :], want, atol=1e-5)


def test_batched_attention_of_rows_of_different_lengths_equals_each_row_alone():
    batch, caches = joined({1: 3, 2: 40, 3: 1})
    batch.release([2])
    caches[5] = kv_cache(17, seed=9)
    batch.join_copy(5, [caches[5]])  # into the hole, shorter than the row it replaces
    own = {r: (own_kv(caches[r]), np.array(caches[r].values[0, :, :caches[r].offset, :]))
           for r in (1, 3, 5)}
    check_steps(batch, own, steps=3, seed=0)


def test_rows_sharing_a_prefixs_pages_attend_over_it_and_write_only_their_own():
    """Two rows whose tables start with the same page (a prefix hit read in place): each
    attends to the shared prefix and its own tokens; the shared page never changes."""
    batch = DecodeBatch(make_store())
    prefix, tail_a, tail_b = kv_cache(16, 1), kv_cache(5, 2), kv_cache(11, 3)
    store = batch.positions.store

    def keys_and_values(c: KVCache) -> tuple[np.ndarray, np.ndarray]:
        return np.array(c.keys[0, :, :c.offset]), np.array(c.values[0, :, :c.offset])

    own = {}
    for row, tail, pages in ((1, tail_a, [3, 6]), (2, tail_b, [3, 8])):
        whole = KVCache()
        whole.update_and_fetch(prefix.keys[..., :16, :], prefix.values[..., :16, :])
        whole.update_and_fetch(tail.keys[..., :tail.offset, :],
                               tail.values[..., :tail.offset, :])
        join_at(batch, row, whole, pages)
        own[row] = keys_and_values(whole)
    mx.eval(store.arrays())
    shared = np.array(store.keys[0][:, 3]), np.array(store.values[0][:, 3])
    check_steps(batch, own, steps=4, seed=7)
    np.testing.assert_array_equal(np.array(store.keys[0][:, 3]), shared[0])
    np.testing.assert_array_equal(np.array(store.values[0][:, 3]), shared[1])


def test_a_step_writes_only_the_live_rows_slots_and_the_scratch_page():
    batch, _ = joined({1: 6, 2: 8, 3: 30, 4: 2})
    batch.release([2])  # a hole
    batch.keep([3, 4])  # row 1 parked
    mx.eval(batch.positions.store.arrays())
    before = pool(batch)
    written = [batch.positions.pages[batch.where[r]][n // PAGE] * PAGE + n % PAGE
               for r, n in ((3, 30), (4, 2))]
    step(batch, seed=5)
    for was, now in zip(before, pool(batch)):
        changed = np.flatnonzero((now != was).any(axis=(0, 3)).reshape(-1))  # slots
        assert set(changed) - set(range(PAGE)) == set(written)


def test_a_parked_row_keeps_its_kv_and_length_while_the_others_decode():
    batch, caches = joined({1: 6, 2: 8})
    batch.keep([2])  # row 1 finished while a step was in flight: parked, not released
    assert batch.rows == [2] and batch.where[1] == 0
    for s in range(3):
        step(batch, seed=s)
    assert batch.positions.lengths[0] == 6 and batch.positions.lengths[1] == 11
    np.testing.assert_array_equal(row_kv(batch, 1), own_kv(caches[1]))
    assert np.array(batch.live_index()).tolist() == [1]


def test_the_batch_never_allocates_a_page():
    """A row at the end of its last page cannot decode until the scheduler's PAGES op extends
    its table (the very list): then its next token goes to the new page's first slot."""
    batch = DecodeBatch(make_store(limit=40))
    store = batch.positions.store
    full, pages = kv_cache(15, seed=1), [5]
    join_at(batch, 1, full, pages)
    join_at(batch, 2, kv_cache(3, seed=2), [6])
    k, _, _ = step(batch, seed=1)  # row 1's 16th token: the last slot of page 5
    held = store.pages
    with pytest.raises(PoolFull, match="a decode row at position 16 has 1 pages"):
        batch.inputs(mx.zeros((16,), mx.int32))
    assert store.pages == held and batch.positions.lengths.tolist() == [16, 4]
    pages.append(9)  # the runner's set_pages: in place
    k2, _, _ = step(batch, seed=2)
    assert batch.positions.lengths.tolist() == [17, 5]
    got = row_kv(batch, 1)
    np.testing.assert_array_equal(got[:, 15], np.array(k[0, :, 0]))
    np.testing.assert_array_equal(got[:, 16], np.array(k2[0, :, 0]))
    np.testing.assert_array_equal(np.array(store.keys[0][:, 9, 0]), np.array(k2[0, :, 0]))
    assert store.pages == held  # page 9 was the scheduler's to give: the pool did not grow


def test_a_parked_row_without_a_page_for_a_next_token_is_not_refused():
    batch = DecodeBatch(make_store())
    join_at(batch, 1, kv_cache(16, seed=1), [2])  # its one page full
    join_at(batch, 2, kv_cache(3, seed=2), [3])
    batch.keep([2])
    step(batch, seed=1)
    assert batch.positions.lengths.tolist() == [16, 4]


def test_positions_compact_only_when_holes_are_more_than_half():
    batch, caches = joined({r: r + 2 for r in range(1, 7)})
    keys = batch.caches[0].keys
    tables = {r: batch.positions.pages[batch.where[r]] for r in (4, 5)}
    batch.release([1, 2, 3])  # 3 holes of 6: not more than half
    assert batch.slots == [None, None, None, 4, 5, 6] and batch.caches[0].keys is keys
    batch.release([6])  # trailing: dropped at once; 3 holes of 5 now: compacted
    assert batch.slots == [4, 5] and batch.where == {4: 0, 5: 1}
    assert batch.caches[0].keys is keys  # only the page tables moved
    assert [batch.positions.pages[i] for i in (0, 1)] == [tables[4], tables[5]]
    step(batch, seed=1)  # and the rows decode on from their new positions
    for row in (4, 5):
        np.testing.assert_array_equal(row_kv(batch, row)[:, :-1], own_kv(caches[row]))
    batch.release([4, 5])
    assert len(batch) == 0 and batch.caches is None  # empty: every buffer goes
    assert batch.positions.pages == []


def test_recurrent_states_follow_the_positions():
    batch = DecodeBatch(KvPages([]))
    for row in (1, 2, 3):
        batch.join(row, [state_cache(row)], [])
    assert isinstance(batch.caches[0], BatchedStates)
    batch.release([2])
    batch.join(9, [state_cache(9)], [])
    assert np.array(batch.caches[0][0][:, 0]).tolist() == [1.0, 9.0, 3.0]
    batch.release([1, 9])  # two holes of three, then the trailing one goes: compacted to [3]
    assert batch.slots == [3]
    assert np.array(batch.caches[0][1]).ravel().tolist() == [-3.0] * 4


def test_standalone_opens_a_pool_for_the_full_attention_layers_only():
    cache = [kv_cache(20, seed=1), state_cache(2), kv_cache(20, seed=3)]
    batch = standalone(cache)
    store = batch.positions.store
    assert store.layers == [0, 2] and set(store.keys) == {0, 2}
    batch.join_copy(1, cache)
    batch.join_copy(2, cache)
    assert isinstance(batch.caches[0], BatchedKV) and isinstance(batch.caches[1], BatchedStates)
    # Pages of their own, past every page in use, room for the next token.
    assert batch.positions.pages == [[1, 2], [3, 4]]
    for row in (1, 2):
        np.testing.assert_array_equal(row_kv(batch, row), own_kv(cache[0]))
    at = batch.positions.pages[1]
    got = gather(store.values[2], mx.array([at], dtype=mx.int32))[0, :, :20]
    np.testing.assert_array_equal(np.array(got), np.array(cache[2].values[0, :, :20]))


def test_a_sequence_of_more_than_one_token_is_refused():
    batch, _ = joined({1: 4})
    with pytest.raises(ValueError, match="one token per row"):
        batch.caches[0].make_mask(3)


def _expected(p: Positions, lengths: list[int], live: list[bool], widths: int) -> dict:
    """What a step's arrays must hold, from the pages alone: each live row's token goes to
    slot length % PAGE of its page length // PAGE, it attends to length + 1 keys through a
    table of its pages padded with the scratch page 0; holes and parked rows write into the
    scratch page and attend to one key."""
    rows = [(n, ok, p.pages[at][:widths] if ok else [])
            for at, (n, ok) in enumerate(zip(lengths, live))]
    return {"written": [p.pages[at][n // PAGE] * PAGE + n % PAGE if ok else 0
                        for at, (n, ok, _) in enumerate(rows)],
            "counts": [n + 1 if ok else 1 for n, ok, _ in rows],
            "table": [pages + [0] * (widths - len(pages)) for _, _, pages in rows]}


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.integers(0, 70), st.booleans(), st.integers(0, 2)),
                     min_size=0, max_size=9),
       round_pages=st.booleans(), seed=st.integers(0, 1000))
def test_a_steps_positions_arrays_follow_the_pages(rows, round_pages, seed):
    """Rows of any length, live or not, with tables of the pages they need and up to two
    more (the scheduler's reserve), page ids scattered over the pool."""
    store = KvPages([0])
    store.ensure(200)
    p = Positions(store)
    p.round_pages = round_pages
    p.resize(len(rows))
    ids = iter(np.random.default_rng(seed).permutation(np.arange(1, 201)).tolist())
    for at, (n, ok, extra) in enumerate(rows):
        p.pages[at] = [next(ids) for _ in range(n // PAGE + 1 + extra)]
        p.lengths[at], p.live[at] = n, ok
    p.prepare()
    lengths, live = [n for n, _, _ in rows], [ok for _, ok, _ in rows]
    most = max([n // PAGE + 1 for n, ok, _ in rows if ok], default=1)  # the pages needed
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
    # The write index of a pool seen flat as [kv_heads x pages x PAGE, dim].
    per_head = store.pages * PAGE
    assert p.writes(2).tolist() == [h * per_head + w for w in want["written"] for h in range(2)]
