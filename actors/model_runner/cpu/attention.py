"""The decode batch's attention through a compiled kernel (mas_kernels.decode_attention).

MLX's CPU attention for the decode batch reads every row up to the batch's longest length
(the rest masked off), first copies the strided K and V views it is given into contiguous
buffers, and with fast math on it leaves the graph for a NumPy softmax in every layer. After a
2,000-token prompt joined 9 rows of ~200 tokens, their decode step went from ~40 to 80-130 ms
(qwen3-small; 54-63 ms with the kernel). The kernel reads each row's own length straight from
the batch's page pool through its page table (decode_batch.BatchedKV): 2.5x MLX's attention
(on rows already laid out contiguously) at 1 row of 2,000 tokens, 3.3-3.6x at 16 rows of 256
or 2,000, 16 GB/s (`python -m benchmarks.kernels.attention`), and no host sync.

mlx-lm's model modules call `scaled_dot_product_attention` through their module globals.
install() points them at `attention`, which takes the kernel for a float32 or bfloat16 BatchedKV layer on
a thread inside active() (the runner's steps); everything else goes on to fastmath.attention,
which is mlx-lm's own unless fast math is active too.
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import base

from actors.model_runner.cpu import fastmath
from actors.model_runner.decode_batch import BatchedKV
from actors.model_runner.kv_pages import pool_in_place, pool_writer
from actors.model_runner.thread_flag import ThreadFlag

MAX_GROUP = 64  # query heads per KV head the kernel takes
# bfloat16 is rounded where MLX's own bf16 attention rounds (q * scale, the scores, the
# weights, the output), so greedy tokens stay mlx-lm's: on qwen3-small-bf16 at 16 rows of 256
# tokens, 0.48 ms a layer against MLX's 6.4 (`python -m benchmarks.kernels.attention`).
KERNEL_DTYPES = (mx.float32, mx.bfloat16)

_kernel: ThreadFlag[Any] = ThreadFlag(None)  # the mas_kernels module, inside active()


@contextmanager
def active(kernels: Any, in_place: bool = False) -> Iterator[None]:
    """Send the decode batch's attention and its pool writes on this thread to `kernels`
    (None: MLX's path). in_place: the writes go into the pool even where a queued read (the
    last step's, or this step's of another row) holds it: no read looks at the slots a write
    changes (kv_pages.py)."""
    write = None if kernels is None else kernels.kv_write
    with _kernel.holding(kernels), pool_writer.holding(write), pool_in_place.holding(in_place):
        yield


def _fits(queries: mx.array, keys: mx.array, values: mx.array, cache: BatchedKV,
          mask: Any) -> bool:
    """The kernel computes softmax(q K^T) V over the rows' pages under the rows' own lengths:
    only for attention over the very K and V the cache handed out, with its mask."""
    b, heads, length, dim = queries.shape
    pool = cache.keys
    return (length == 1 and pool is not None and cache.fetched is not None
            and keys is cache.fetched[0] and values is cache.fetched[1]
            and (mask is None or mask is cache.positions.mask)
            and queries.dtype in KERNEL_DTYPES and pool.dtype == queries.dtype
            and dim % 16 == 0 and pool.shape[-1] == dim and cache.values.shape == pool.shape
            and heads % pool.shape[0] == 0 and heads // pool.shape[0] <= MAX_GROUP)


def takes_kernel(queries: mx.array, keys: mx.array, values: mx.array, cache: Any,
                 mask: Any) -> bool:
    """Whether attention() of these would be the decode kernel (on this thread, now)."""
    return (_kernel.get() is not None and isinstance(cache, BatchedKV)
            and _fits(queries, keys, values, cache, mask))


def attention(queries: mx.array, keys: mx.array, values: mx.array, cache, scale: float,
              mask, sinks=None) -> mx.array:
    """mlx-lm's scaled_dot_product_attention; the kernel for the decode batch's layers."""
    if sinks is None and takes_kernel(queries, keys, values, cache, mask):
        p = cache.positions
        return _kernel.get().decode_attention(queries, cache.keys, cache.values, p.table,
                                              p.keys_per_row, scale)
    return fastmath.attention(queries, keys, values, cache=cache, scale=scale, mask=mask,
                              sinks=sinks)


def install(model: nn.Module) -> int:
    """Point the model's modules' attention at `attention` (CPU only). Returns how many module
    globals were changed; a second call changes nothing."""
    if mx.default_device() != mx.cpu:
        return 0
    changed = 0
    names = {type(layer).__module__ for _, layer in model.named_modules()}
    for module in filter(None, (sys.modules.get(name) for name in names)):
        if module is not base and getattr(module, "scaled_dot_product_attention", None) in (
                base.scaled_dot_product_attention, fastmath.attention):
            module.scaled_dot_product_attention = attention
            changed += 1
    return changed
