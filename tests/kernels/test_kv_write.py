"""A decode step's writes into a page pool as one graph node (mas_kernels.kv_write, used by
decode_batch.BatchedKV inside the runner's steps): the same pool as MLX's scatter through the
pool seen flat, in float32 and bfloat16 and from strided rows; written in place when nothing
else holds the pool and copied (the held pool untouched) when something does; bad arguments
named; and the runner's decode writing its pools in place step after step."""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402

from actors.model_runner.decode_batch import PAGE  # noqa: E402

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


@pytest.mark.parametrize("name", ["qwen3-tiny", "qwen3-tiny-4bit"])
def test_the_runners_decode_writes_its_pools_in_place(name, model_cache):
    """The runner core's overlapped decode (depth 2: step N+1 built while step N runs),
    compiled and eager, writes through the kernel and never has to copy a pool. Its tokens
    are mlx-lm's (greedy)."""
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
            writes.append((pool.shape, kw))
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
        assert writes, "the decode steps did not write through the kernel"
        # In place only in the plain decode steps queued early (compiled, runner.early_queue);
        # steps that also join, park or save rows write as MLX would.
        kinds = {kw["in_place"] for _, kw in writes}
        assert kinds == ({True, False} if compile_decode else {False}), kinds
        assert mk._ext._kv_write_copies() == copies
        if compile_decode:  # the compiled forward ran its traces, not the eager one
            assert runner.compiled is not None and runner.compiled.off is None
            assert runner.compiled.calls > 20
        else:
            assert runner.compiled is None
        for reqs in arrivals.values():
            for rid, ids, n in reqs:
                oracle.check(ids, tokens[rid], oracle.greedy(ids, n))
