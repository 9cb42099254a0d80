"""The decode attention kernel (mas_kernels.decode_attention) and its use by the runner.

The kernel reads each row's own length of the decode batch's K/V page pool through the row's
page table; it must equal MLX's attention over that row's keys alone, on every instruction-set
path this CPU has, for the shapes the models have (GQA groups, head dims 64-128, rows of length
1 to their pages' end, holes of length 0), pages of any size in any order.
"""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402
from mlx_lm.models import base  # noqa: E402
from mlx_lm.models.cache import KVCache  # noqa: E402

from actors.model_runner.cpu import attention  # noqa: E402
from actors.model_runner.decode_batch import standalone  # noqa: E402


def reference(q, k, v, lengths, scale):
    """MLX's attention for each row over its own keys; zeros for a row of length 0."""
    rows = []
    for b, n in enumerate(lengths):
        if n == 0:
            rows.append(mx.zeros(q[b:b + 1].shape))
            continue
        rows.append(mx.fast.scaled_dot_product_attention(
            q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], scale=scale))
    return mx.concatenate(rows)


def contiguous(rows: int) -> mx.array:
    """The page table of a [rows, kv_heads, columns, dim] buffer: one page per row."""
    return mx.arange(rows, dtype=mx.int32)[:, None]


def as_pool(k: mx.array) -> mx.array:
    """That buffer as the kernel's head-major pool [kv_heads, pages, page, dim] (a view)."""
    return k.transpose(1, 0, 2, 3)


@pytest.mark.parametrize("heads,kv_heads,dim,columns,lengths", [
    (16, 4, 64, 300, [1, 257, 100, 300]),  # qwen3-small's shape; a row at full capacity
    (8, 8, 128, 64, [64, 1, 0, 33, 2]),  # no GQA; a hole (length 0)
    (14, 2, 80, 40, [40, 17]),  # group of 7, dim 80 (5 chunks of 16)
    (32, 1, 16, 5, [5]),  # one KV head for 32 query heads
])
def test_matches_mlx_attention_over_each_rows_keys(isa, heads, kv_heads, dim, columns, lengths):
    rng = np.random.default_rng(len(lengths) * dim)
    b = len(lengths)
    q = mx.array(rng.standard_normal((b, heads, 1, dim)).astype(np.float32))
    # Spare buffer rows past b and garbage past each length: the kernel must not read them.
    k = mx.array(rng.standard_normal((b + 2, kv_heads, columns, dim)).astype(np.float32) * 3)
    v = mx.array(rng.standard_normal((b + 2, kv_heads, columns, dim)).astype(np.float32))
    got = mk.decode_attention(q, as_pool(k), as_pool(v), contiguous(b),
                              mx.array(lengths, dtype=mx.int32), 0.125)
    want = reference(q, k, v, lengths, 0.125)
    assert got.shape == q.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim,columns,lengths,scale", [
    (16, 4, 64, 300, [1, 257, 100, 300], 64 ** -0.5),
    (8, 8, 128, 64, [64, 1, 0, 33, 2], 128 ** -0.5),  # a scale bf16 cannot hold exactly
    (14, 2, 80, 40, [40, 17], 80 ** -0.5),
])
def test_bfloat16_has_mlx_bf16_attentions_bits(isa, heads, kv_heads, dim, columns, lengths,
                                               scale):
    """A bf16 model's decode attention: MLX rounds q * scale, the scores, the softmax weights
    and the output to bf16; the kernel rounds at the same places, so it gives the same bits
    (float32 throughout would be off by bf16 ulps, and greedy tokens could drift)."""
    rng = np.random.default_rng(dim)
    b = len(lengths)

    def bf16(*shape, sd=1.0):
        return mx.array(rng.standard_normal(shape).astype(np.float32) * sd).astype(mx.bfloat16)

    q = bf16(b, heads, 1, dim, sd=2.0)
    k, v = bf16(b + 2, kv_heads, columns, dim, sd=3.0), bf16(b + 2, kv_heads, columns, dim)
    got = mk.decode_attention(q, as_pool(k), as_pool(v), contiguous(b),
                              mx.array(lengths, dtype=mx.int32), scale)
    want = reference(q, k, v, lengths, scale).astype(mx.bfloat16)
    assert got.dtype == mx.bfloat16
    assert np.array_equal(np.array(got.astype(mx.float32)), np.array(want.astype(mx.float32)))


@pytest.mark.parametrize("page", [1, 16, 7])
def test_reads_each_rows_tokens_through_its_page_table(isa, page):
    """Rows whose pages are scattered over a shared pool, in any order, with unused table
    entries past their last page: the same as MLX's attention over each row's tokens."""
    rng = np.random.default_rng(page)
    heads, kv_heads, dim, lengths = 8, 2, 64, [35, 1, 0, 16, 48]
    most = -(-max(lengths) // page) + 1
    pool_pages = sum(-(-n // page) for n in lengths) + 5
    ids = rng.permutation(pool_pages)
    table = np.zeros((len(lengths), most), np.int32)
    at = 0
    for b, n in enumerate(lengths):
        used = -(-n // page)
        table[b, :used] = ids[at:at + used]
        table[b, used:] = ids[-1]  # past the row's length: never read
        at += used
    pool_k = rng.standard_normal((kv_heads, pool_pages, page, dim)).astype(np.float32)
    pool_v = rng.standard_normal((kv_heads, pool_pages, page, dim)).astype(np.float32)
    q = mx.array(rng.standard_normal((len(lengths), heads, 1, dim)).astype(np.float32))
    got = mk.decode_attention(q, mx.array(pool_k), mx.array(pool_v), mx.array(table),
                              mx.array(lengths, dtype=mx.int32), 0.2)
    # Each row's tokens laid out contiguously, for the reference.
    k = pool_k[:, table].transpose(1, 0, 2, 3, 4).reshape(len(lengths), kv_heads, most * page,
                                                          dim)
    v = pool_v[:, table].transpose(1, 0, 2, 3, 4).reshape(len(lengths), kv_heads, most * page,
                                                          dim)
    want = reference(q, mx.array(k), mx.array(v), lengths, 0.2)
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def test_large_scores_do_not_overflow(isa):
    """Softmax subtracts each row's maximum: scores of ~1e4 still give finite weights."""
    q = mx.full((1, 2, 1, 16), 30.0)
    k = mx.concatenate([mx.full((1, 1, 3, 16), 20.0), mx.full((1, 1, 3, 16), -20.0)], axis=2)
    v = mx.arange(6 * 16, dtype=mx.float32).reshape(1, 1, 6, 16)
    got = mk.decode_attention(q, as_pool(k), as_pool(v), contiguous(1),
                              mx.array([6], dtype=mx.int32), 1.0)
    want = reference(q, k, v, [6], 1.0)
    assert np.isfinite(np.array(got)).all()
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5)


def test_lazy_in_a_graph_and_strided_query():
    """A lazy node like MLX's own: inputs computed in the same graph, a transposed query."""
    q = mx.random.normal((3, 1, 8, 64), key=mx.random.key(5)).transpose(0, 2, 1, 3)  # strided
    k = mx.random.normal((3, 2, 10, 64), key=mx.random.key(6)) * 2
    v = mx.random.normal((3, 2, 10, 64), key=mx.random.key(7)) + 1
    lengths = mx.array([10, 4, 7], dtype=mx.int32)
    got = mk.decode_attention(q, as_pool(k), as_pool(v), contiguous(3), lengths, 0.3) * 2
    want = reference(q, k, v, [10, 4, 7], 0.3) * 2
    # Outputs of ~2 summed in another order: float32 rounding, a few ulps of 2 apart.
    np.testing.assert_allclose(np.array(got), np.array(want), atol=1e-5, rtol=1e-5)


def test_bad_arguments_raise():
    q, k = mx.zeros((2, 4, 1, 16)), mx.zeros((2, 2, 8, 16))
    n, t = mx.array([1, 2], dtype=mx.int32), contiguous(2)
    with pytest.raises(ValueError, match="float32"):
        mk.decode_attention(q.astype(mx.float16), k, k, t, n, 1.0)
    with pytest.raises(ValueError, match="all bfloat16"):
        mk.decode_attention(q.astype(mx.bfloat16), k, k, t, n, 1.0)
    with pytest.raises(ValueError, match=r"\[rows, heads, 1, dim\]"):
        mk.decode_attention(mx.zeros((2, 4, 2, 16)), k, k, t, n, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        mk.decode_attention(q, k, mx.zeros((2, 2, 9, 16)), t, n, 1.0)
    with pytest.raises(ValueError, match="does not match"):
        mk.decode_attention(q, mx.zeros((2, 2, 8, 32)), mx.zeros((2, 2, 8, 32)), t, n, 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        mk.decode_attention(mx.zeros((2, 4, 1, 24)), mx.zeros((2, 2, 8, 24)),
                            mx.zeros((2, 2, 8, 24)), t, n, 1.0)
    with pytest.raises(ValueError, match="int32"):
        mk.decode_attention(q, k, k, t, mx.array([1, 2]).astype(mx.int64), 1.0)
    with pytest.raises(ValueError, match="pages must be int32"):
        mk.decode_attention(q, k, k, contiguous(3), n, 1.0)
    with pytest.raises(RuntimeError, match="past its pages"):
        mx.eval(mk.decode_attention(q, k, k, t, mx.array([1, 9], dtype=mx.int32), 1.0))
    with pytest.raises(RuntimeError, match="outside the K/V pool"):
        mx.eval(mk.decode_attention(q, k, k, mx.array([[0], [2]], dtype=mx.int32), n, 1.0))


def decode_layer():
    """One attention layer of a decode batch as the forward sees it: rows of their own lengths
    in pages, a hole between them, and this step's K/V written (update_and_fetch)."""
    own = {}
    for row, length in ((1, 5), (2, 3), (3, 40)):
        own[row] = KVCache()
        own[row].update_and_fetch(mx.random.normal((1, 2, length, 32)),
                                  mx.random.normal((1, 2, length, 32)))
    batch = standalone([own[1]])  # a pool of its own, shaped like the rows' K/V
    for row, cache in own.items():
        batch.join_copy(row, [cache])
    batch.release([2])
    batch.inputs(mx.zeros((4,), mx.int32))
    kv = batch.caches[0]
    keys, values = kv.update_and_fetch(mx.random.normal((3, 2, 1, 32)),
                                       mx.random.normal((3, 2, 1, 32)))
    return kv, keys, values


def test_dispatch_takes_the_kernel_inside_active_only(monkeypatch):
    mx.random.seed(3)
    kv, keys, values = decode_layer()
    q = mx.random.normal((3, 4, 1, 32))
    mask = kv.positions.mask
    stock = base.scaled_dot_product_attention(q, keys, values, cache=kv, scale=0.2, mask=mask)
    calls = []
    real = mk.decode_attention
    monkeypatch.setattr(mk, "decode_attention", lambda *a: calls.append(1) or real(*a))
    outside = attention.attention(q, keys, values, cache=kv, scale=0.2, mask=mask)
    assert not calls and mx.array_equal(outside, stock).item()  # no kernel: MLX's own bits
    with attention.active(mk):
        inside = attention.attention(q, keys, values, cache=kv, scale=0.2, mask=mask)
        sinks = attention.attention(q, keys, values, cache=kv, scale=0.2, mask=mask,
                                    sinks=mx.zeros((4,)))
    assert len(calls) == 1  # attention sinks stay on MLX's path
    # Each row attends to its length + 1 keys (the token written in this step), as the mask;
    # the hole attends to the scratch page's one key on both paths.
    np.testing.assert_allclose(np.array(inside), np.array(stock), atol=2e-6, rtol=1e-5)
    assert sinks.shape == stock.shape


def test_runner_installs_it_with_the_compiled_kernels(model_cache):
    from actors.model_runner.loading import load_model
    from actors.model_runner.runner import ModelRunner
    from models.builtin import ensure_builtin
    from protocol.config import RuntimeConfig

    path = str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False))
    assert ModelRunner(load_model(path), 4).cpu.decode_attention
    fallback = ModelRunner(load_model(path), 4, runtime=RuntimeConfig(weights="jit"))
    assert not fallback.cpu.decode_attention


def test_runner_sets_the_buffer_cache_limit(model_cache):
    from actors.model_runner.loading import load_model
    from actors.model_runner.runner import ModelRunner
    from models.builtin import ensure_builtin
    from protocol.config import RuntimeConfig

    path = str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False))
    before = mx.set_cache_limit(0)
    try:
        runner = ModelRunner(load_model(path), 4, runtime=RuntimeConfig(buffer_cache_mib=300))
        assert runner.cpu.buffer_cache_mib == 300
        assert mx.set_cache_limit(0) == 300 << 20
        mx.set_cache_limit(before)
        kept = ModelRunner(load_model(path), 4, runtime=RuntimeConfig(buffer_cache_mib=0))
        assert kept.cpu.buffer_cache_mib == 0 and mx.set_cache_limit(0) == before
    finally:
        mx.set_cache_limit(before)
