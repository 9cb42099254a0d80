"""A sliding-window layer's memory as a state value: what a prefix snapshot keeps of it.

A sliding-window layer (mlx-lm's RotatingKVCache) attends to the last `window` positions
only, so a cached prefix cannot be rebuilt from the KV pool's per-token slots the way a
full-attention layer is: its K and V of the window before the prefix's end are kept instead,
like a recurrent layer's state, in the state pool at the radix node (docs/architecture.md,
section 7, "Layer kinds and the prefix cache"). The value is what mlx-lm's own merge keeps
of a cache: the last min(offset, window) positions in time order. Its offset is the prefix's
length, which the restore knows (the state is restored with the prefix's KV slots, as a
recurrent layer's is).
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import RotatingKVCache

from actors.model_runner.pipeline import before_host_sync


def window_of(cache: RotatingKVCache) -> list[mx.array | None]:
    """[keys, values] of a row's own cache, [1, kv_heads, n, dim] for its last n = min(offset,
    window) positions, oldest first ([None, None] before any). Lazy: a slice, and a reorder
    where the cache has wrapped around."""
    n = cache.size()
    if cache.keys is None or n == 0:
        return [None, None]
    keys = cache._temporal_order(cache.keys)[..., -n:, :]
    values = cache._temporal_order(cache.values)[..., -n:, :]
    return [mx.contiguous(keys), mx.contiguous(values)]


def row_window(batch: Any, index: int) -> list[mx.array]:
    """The window of row `index` of mlx-lm's merged batch cache (BatchRotatingKVCache). Its
    extract reads the rows' paddings back to the host."""
    before_host_sync()
    return window_of(batch.extract(index))


def restore_window(cache: RotatingKVCache, value: list[mx.array | None], offset: int) -> None:
    """A fresh cache set to the window a snapshot kept at `offset` tokens."""
    keys, values = value
    if keys is None:
        return
    if keys.shape[2] != min(offset, cache.max_size):
        raise ValueError(f"a window of {keys.shape[2]} positions for a prefix of {offset} "
                         f"tokens (window {cache.max_size})")
    # New handles: the cache writes decode tokens into its arrays in place (`keys[...] = k`),
    # which would change the snapshot, and every other row restored from it, too.
    cache.keys, cache.values = mx.array(keys), mx.array(values)
    cache.offset, cache._idx = offset, keys.shape[2]
