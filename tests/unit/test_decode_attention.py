"""The decode attention kernel (mas_kernels.decode_attention) and its use by the runner.

The kernel reads each row's own length of the decode batch's K/V buffers; it must equal MLX's
attention over that row's keys alone, on every instruction-set path this CPU has, for the
shapes the models have (GQA groups, head dims 64-128, rows of length 1 to the buffer's
columns, holes of length 0).
"""

from __future__ import annotations

import numpy as np
import pytest

mk = pytest.importorskip(
    "mas_kernels", reason="mas_kernels is not built (pip install --no-build-isolation ./native)")
import mlx.core as mx  # noqa: E402
from mlx_lm.models import base  # noqa: E402

from actors.model_runner.cpu import attention  # noqa: E402
from actors.model_runner.decode_batch import BatchedKV, Positions  # noqa: E402
from tests.unit.test_kernels import isa  # noqa: E402,F401  (every path this CPU has)


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
    got = mk.decode_attention(q, k, v, mx.array(lengths, dtype=mx.int32), 0.125)
    want = reference(q, k, v, lengths, 0.125)
    assert got.shape == q.shape and got.dtype == mx.float32
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def test_large_scores_do_not_overflow(isa):
    """Softmax subtracts each row's maximum: scores of ~1e4 still give finite weights."""
    q = mx.full((1, 2, 1, 16), 30.0)
    k = mx.concatenate([mx.full((1, 1, 3, 16), 20.0), mx.full((1, 1, 3, 16), -20.0)], axis=2)
    v = mx.arange(6 * 16, dtype=mx.float32).reshape(1, 1, 6, 16)
    got = mk.decode_attention(q, k, v, mx.array([6], dtype=mx.int32), 1.0)
    want = reference(q, k, v, [6], 1.0)
    assert np.isfinite(np.array(got)).all()
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5)


def test_lazy_in_a_graph_and_strided_query():
    """A lazy node like MLX's own: inputs computed in the same graph, a transposed query."""
    q = mx.random.normal((3, 1, 8, 64)).transpose(0, 2, 1, 3)  # [3, 8, 1, 64], strided
    k = mx.random.normal((3, 2, 10, 64)) * 2
    v = mx.random.normal((3, 2, 10, 64)) + 1
    lengths = mx.array([10, 4, 7], dtype=mx.int32)
    got = mk.decode_attention(q, k, v, lengths, 0.3) * 2
    want = reference(q, k, v, [10, 4, 7], 0.3) * 2
    np.testing.assert_allclose(np.array(got), np.array(want), atol=2e-6, rtol=1e-5)


def test_bad_arguments_raise():
    q, k = mx.zeros((2, 4, 1, 16)), mx.zeros((2, 2, 8, 16))
    n = mx.array([1, 2], dtype=mx.int32)
    with pytest.raises(ValueError, match="float32"):
        mk.decode_attention(q.astype(mx.float16), k, k, n, 1.0)
    with pytest.raises(ValueError, match=r"\[rows, heads, 1, dim\]"):
        mk.decode_attention(mx.zeros((2, 4, 2, 16)), k, k, n, 1.0)
    with pytest.raises(ValueError, match="one shape"):
        mk.decode_attention(q, k, mx.zeros((2, 2, 9, 16)), n, 1.0)
    with pytest.raises(ValueError, match="does not match"):
        mk.decode_attention(q, mx.zeros((1, 2, 8, 16)), mx.zeros((1, 2, 8, 16)), n, 1.0)
    with pytest.raises(ValueError, match="multiple of 16"):
        mk.decode_attention(mx.zeros((2, 4, 1, 24)), mx.zeros((2, 2, 8, 24)),
                            mx.zeros((2, 2, 8, 24)), n, 1.0)
    with pytest.raises(ValueError, match="int32"):
        mk.decode_attention(q, k, k, mx.array([1, 2]).astype(mx.int64), 1.0)
    with pytest.raises(RuntimeError, match="past the K/V columns"):
        mx.eval(mk.decode_attention(q, k, k, mx.array([1, 9], dtype=mx.int32), 1.0))


def batched_layer(lengths: list[int], columns: int = 64):
    """A BatchedKV as the decode forward sees it: rows of their own lengths, a hole at 0."""
    positions = Positions()
    positions.resize(len(lengths))
    positions.lengths[:] = lengths
    positions.prepare()
    kv = BatchedKV(positions)
    kv.keys = mx.random.normal((len(lengths) + 1, 2, columns, 32))
    kv.values = mx.random.normal((len(lengths) + 1, 2, columns, 32))
    return kv


def test_dispatch_takes_the_kernel_inside_active_only(monkeypatch):
    mx.random.seed(3)
    kv = batched_layer([5, 0, 20])
    q = mx.random.normal((3, 4, 1, 32))
    keys, values = kv.keys[:3, :, :kv.positions.width], kv.values[:3, :, :kv.positions.width]
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
    # Each row attends to its length + 1 keys (the token written in this step), as the mask.
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
