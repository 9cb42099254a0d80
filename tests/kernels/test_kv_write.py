"""Writes into the page pool as one graph node (mas_kernels.kv_write, used by the one pool's
KvPages.write inside the runner's steps, for decode tokens and prompt chunks alike): the same
pool as MLX's scatter through the pool seen flat, in float32 and bfloat16 and from strided
rows; written in place when nothing else holds the pool and copied (the held pool untouched)
when something does, or in place even then when told (pool_in_place); bad arguments named;
and the runner writing its pools in place step after step."""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402

from actors.model_runner.kv_pages import (PAGE, KvPages, pool_in_place,  # noqa: E402
                                          pool_writer, slots_of)

HEADS, PAGES, DIM = 4, 6, 64


def _slots(rows_pages: list[tuple[int, int]]) -> np.ndarray:
    """The flat slot of (page, position in page) for each row and head, in the rows' order."""
    return np.array([h * PAGES * PAGE + page * PAGE + at for page, at in rows_pages
                     for h in range(HEADS)], np.int32)


def _scattered(pool: mx.array, index: np.ndarray, rows: mx.array) -> np.ndarray:
    flat = pool.reshape(-1, DIM)
    flat[mx.array(index)] = rows.reshape(-1, DIM)
    return np.array(flat.reshape(pool.shape).astype(mx.float32))


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_writes_what_mlx_scatter_writes(dtype):
    pool = mx.random.normal((HEADS, PAGES, PAGE, DIM), key=mx.random.key(1)).astype(dtype)
    index = _slots([(0, 3), (4, 0), (5, PAGE - 1)])
    rows = mx.random.normal((3, HEADS, 1, DIM), key=mx.random.key(2)).astype(dtype)
    want = _scattered(pool, index, rows)
    got = mk.kv_write(pool, mx.array(index), rows)
    np.testing.assert_array_equal(np.array(got.astype(mx.float32)), want)
    # Rows as the model hands values over: [n, 1, heads, dim] transposed, a strided view.
    strided = mx.random.normal((3, 1, HEADS, DIM), key=mx.random.key(3)).astype(dtype)
    strided = strided.transpose(0, 2, 1, 3)
    want = _scattered(got, index, strided)
    np.testing.assert_array_equal(
        np.array(mk.kv_write(got, mx.array(index), strided).astype(mx.float32)), want)


def test_a_strided_pool_is_copied_once_then_written():
    """A pool that is a strided view (never the runner's) is laid out afresh and written."""
    pool = mx.random.normal((PAGES, HEADS, PAGE, DIM), key=mx.random.key(9)).transpose(1, 0, 2, 3)
    index = _slots([(2, 1), (3, 5)])
    rows = mx.random.normal((2, HEADS, 1, DIM), key=mx.random.key(10))
    want = _scattered(pool, index, rows)
    np.testing.assert_array_equal(np.array(mk.kv_write(pool, mx.array(index), rows)), want)


def test_in_place_unless_the_pool_is_held():
    index, rows = mx.array(_slots([(1, 2)])), mx.ones((1, HEADS, 1, DIM))
    pool = mx.zeros((HEADS, PAGES, PAGE, DIM))
    mx.eval(pool, index, rows)
    copies = mk._ext._kv_write_copies()
    pool = mk.kv_write(pool, index, rows)  # nothing else holds the old pool: donated
    mx.eval(pool)
    assert mk._ext._kv_write_copies() == copies
    held = pool
    written = mk.kv_write(pool, index, rows * 2)  # `held` still reads it: copied first
    mx.eval(written)
    assert mk._ext._kv_write_copies() == copies + 1
    assert float(held.max()) == 1.0 and float(written.max()) == 2.0


def test_in_place_even_where_the_pool_is_held_when_told():
    """in_place (the runner's pools): written into the buffer the holder reads too, never
    copied; a strided view is still laid out afresh, never written through."""
    index, rows = mx.array(_slots([(1, 2)])), mx.ones((1, HEADS, 1, DIM))
    pool = mx.zeros((HEADS, PAGES, PAGE, DIM))
    mx.eval(pool, index, rows)
    held, copies = pool, mk._ext._kv_write_copies()
    written = mk.kv_write(pool, index, rows * 3, in_place=True)
    mx.eval(written)
    assert mk._ext._kv_write_copies() == copies
    assert float(written.max()) == 3.0 and float(held.max()) == 3.0  # one buffer
    base = mx.zeros((PAGES, HEADS, PAGE, DIM))
    view = base.transpose(1, 0, 2, 3)
    mx.eval(base, view)
    out = mk.kv_write(view, index, rows, in_place=True)
    mx.eval(out)
    assert mk._ext._kv_write_copies() == copies + 1
    assert float(out.max()) == 1.0 and float(base.max()) == 0.0


def test_bad_arguments_raise():
    pool, rows = mx.zeros((HEADS, PAGES, PAGE, DIM)), mx.zeros((2, HEADS, 1, DIM))
    index = mx.array(_slots([(0, 0), (0, 1)]))
    with pytest.raises(ValueError, match="pool must be"):
        mk.kv_write(pool.reshape(-1, DIM), index, rows)
    with pytest.raises(ValueError, match="rows must be"):
        mk.kv_write(pool, index, rows.astype(mx.bfloat16))
    with pytest.raises(ValueError, match="rows must be"):
        mk.kv_write(pool, index, mx.zeros((2, HEADS, 2, DIM)))
    with pytest.raises(ValueError, match="index must be"):
        mk.kv_write(pool, index[:3], rows)
    with pytest.raises(ValueError, match="index must be"):
        mk.kv_write(pool, index.astype(mx.int64), rows)


def _store(dtype) -> KvPages:
    """A two-layer pool of random contents: a stray write shows."""
    store = KvPages([0, 1])
    for i, layer in enumerate(store.layers):
        for j, arrays in enumerate((store.keys, store.values)):
            arrays[layer] = mx.random.normal((HEADS, PAGES, PAGE, DIM),
                                             key=mx.random.key(30 + 2 * i + j)).astype(dtype)
    store.pages = PAGES
    mx.eval(store.arrays())
    return store


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_the_pools_writes_through_the_kernel_are_mlxs(dtype):
    """KvPages.write with the kernel held (the runner's steps) and without (MLX's scatter):
    a prompt chunk across pages and a decode step's tokens land the same, one node each for
    K and V; keys of another dtype than the pool's take MLX's path."""
    chunk = slots_of([4, 1], 5, 25)  # a chunk of 20 tokens across two pages
    rows = mx.random.normal((len(chunk), HEADS, 1, DIM), key=mx.random.key(40)).astype(dtype)
    stores = {}
    for writer in (None, mk.kv_write):
        store = _store(dtype)
        calls = []

        def counted(pool, index, new, **kw):
            calls.append(kw)
            return writer(pool, index, new, **kw)

        with pool_writer.holding(None if writer is None else counted):
            store.write(1, store.index(chunk, HEADS), rows, rows * 2)
            store.write(0, store.index(np.array([3, 2 * PAGE + 7]), HEADS), rows[:2],
                        rows[2:4])
        assert len(calls) == (0 if writer is None else 4)
        stores[writer] = store
    for a, b in zip(stores[None].arrays(), stores[mk.kv_write].arrays()):
        np.testing.assert_array_equal(np.array(a.astype(mx.float32)),
                                      np.array(b.astype(mx.float32)))
    store, calls = _store(dtype), []
    with pool_writer.holding(lambda *a, **kw: calls.append(1)):
        store.write(0, store.index(chunk, HEADS), rows.astype(mx.float16),
                    rows.astype(mx.float16))
    assert not calls and store.keys[0].dtype == dtype


def test_the_pool_writes_in_place_where_told():
    """pool_in_place reaches the kernel: the array a queued read holds sees the write (one
    buffer, no copy); without it the held array is left as it was."""
    index = np.array([PAGE + 2])
    rows = mx.full((1, HEADS, 1, DIM), 7.0)
    for in_place in (False, True):
        store = _store(mx.float32)
        held, copies = store.keys[0], mk._ext._kv_write_copies()
        with pool_writer.holding(mk.kv_write), pool_in_place.holding(in_place):
            store.write(0, store.index(index, HEADS), rows, rows)
        mx.eval(store.arrays())
        assert float(store.keys[0][0, 1, 2, 0]) == 7.0
        assert (float(held[0, 1, 2, 0]) == 7.0) == in_place
        # Only K is held: V's old buffer has no other reader and is donated either way.
        assert mk._ext._kv_write_copies() == copies + (0 if in_place else 1)


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-tiny-4bit"])
def test_the_runners_decode_writes_its_pools_in_place(name, model_cache):
    """The runner core's overlapped steps (depth 2: step N+1 built while step N runs),
    compiled and eager, write prompt chunks and decode tokens through the kernel, in place,
    and never have to copy a pool. Its tokens are mlx-lm's (greedy)."""
    from actors.model_runner.loading import load_model
    from actors.model_runner.runner import ModelRunner
    from actors.scheduler.core import Scheduler
    from models.builtin import ensure_builtin
    from models.info import read_model_info
    from protocol.config import RuntimeConfig
    from harness.oracle import Oracle
    from tests.support.drive import drive

    path = str(ensure_builtin(name, cache_dir=model_cache, progress=False))
    info, oracle = read_model_info(path), Oracle(path)
    prompts = {f"r{i}": oracle.tokenizer.encode(f"Hello world {i} " * (3 + 5 * i))
               for i in range(3)}
    arrivals = {0: [("r0", prompts["r0"], 40)], 3: [("r1", prompts["r1"], 30)],
                6: [("r2", prompts["r2"], 12)]}
    original = mk.kv_write
    for compile_decode in (True, False):
        writes = []

        def counted(pool, index, rows, **kw):
            writes.append((rows.shape[0], kw))
            return original(pool, index, rows, **kw)

        runner = ModelRunner(load_model(path), 3, kv_slots=1 << 12,
                             runtime=RuntimeConfig(compile_decode=compile_decode))
        sched = Scheduler(max_running=3, chunked_prefill_size=16, kv_slots=1 << 12,
                          context_length=info.context_length, eos_ids=[], output_reserve=64)
        copies = mk._ext._kv_write_copies()
        mk.kv_write = counted
        try:
            tokens, _, _ = drive(sched, runner, arrivals, 2)
        finally:
            mk.kv_write = original
        # Every step writes in place (kv_pages.py: a write never touches a slot a queued
        # read looks at): the decode steps' few rows and the prompt chunks' up to 16.
        tokens_written = {n for n, _ in writes}
        assert min(tokens_written) <= 3 < max(tokens_written) <= 16, tokens_written
        kinds = {kw["in_place"] for _, kw in writes}
        assert kinds == {True}, kinds
        assert mk._ext._kv_write_copies() == copies
        if compile_decode:  # the compiled forward ran its traces, not the eager one
            assert runner.compiled is not None and runner.compiled.off is None
            assert runner.compiled.calls > 20
        else:
            assert runner.compiled is None
        for reqs in arrivals.values():
            for rid, ids, n in reqs:
                oracle.check(ids, tokens[rid], oracle.greedy(ids, n))
