"""The one KV pool (docs/architecture.md, section 8): every full-attention layer's K and V of
every request, prompt and decode alike, and the prefix tree's cached prefixes, in pages the
scheduler hands out. Slot id s is token s % PAGE of page s // PAGE, the page ids come in
PAGES ops (storage.py), so the runner's page table of a row is the scheduler's, and a prefix
hit reads the tree's pages where they are: nothing is copied into the pool or out of it but
a hit's partial last page (KV_COPY).

Per layer, K and V are [kv_heads, pages, PAGE, dim] (head-major: a row's run of pages is one
contiguous stretch per head, as the decode kernel reads it). The arrays hold the pages handed
out so far, doubling (a copy) when a page id past them arrives, never beyond the scheduler's
budget: the budget bounds what the runner holds, and a small model on a big machine does not
fault in gigabytes it never uses.

Writes go to slots only their row owns, and a step reads a slot only where it was written by
an earlier write or step, so a write may go in place even while a read of the same array is
still queued (cpu/attention.active): the reads never look at the slots it changes.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from actors.model_runner.errors import StepError
from actors.model_runner.pipeline import before_host_sync
from actors.model_runner.thread_flag import ThreadFlag
from protocol.messages import KV_PAGE as PAGE

FIRST_PAGES = 64  # the arrays' first size in pages (page 0, the scratch page, among them)

# The CPU kernels' pool write (mas_kernels.kv_write), held on the runner's thread inside its
# steps (cpu/attention.active); None elsewhere: MLX's scatter. Written with MLX's indexing, a
# pool's write is four graph nodes (reshapes around a scatter); the kernel's is one. Each node
# costs the CPU stream and the submitting thread microseconds whatever its size: qwen3-small-4bit
# at one row, compiled, the step's 64 nodes of writes cost ~0.5-1 ms of a ~5.5 ms step.
pool_writer: ThreadFlag[Any] = ThreadFlag(None)
# Whether those writes go in place even where the pool is held (see the module's docstring).
pool_in_place: ThreadFlag[bool] = ThreadFlag(False)


class PoolFull(StepError):
    """A page id past the budget: the scheduler addressed memory it does not have."""


class KvPages:
    def __init__(self, layers: list[int], limit: int | None = None):
        """layers: the full-attention layers; limit: pages the budget allows (page 0
        included), None for no bound (a runner driven without a scheduler's budget)."""
        self.layers, self.limit = layers, limit
        self.keys: dict[int, mx.array] = {}
        self.values: dict[int, mx.array] = {}
        self.pages = 0  # pages the arrays hold

    def open(self, cache: list[Any]) -> None:
        """Every layer's arrays at FIRST_PAGES, shaped like the K and V of `cache` (a prompt's
        mlx-lm caches after one token), allocated and faulted in now, at startup."""
        first = FIRST_PAGES if self.limit is None else min(FIRST_PAGES, self.limit)
        for layer in self.layers:
            for store, like in ((self.keys, cache[layer].keys), (self.values, cache[layer].values)):
                store[layer] = mx.zeros((like.shape[1], first, PAGE, like.shape[-1]), like.dtype)
        self.pages = first
        mx.eval(self.arrays())

    def ensure(self, top: int) -> None:
        """Room for page id `top`: the arrays double (copying what they hold) up to the limit."""
        if top < self.pages or not self.layers:
            return
        if self.limit is not None and top >= self.limit:
            raise PoolFull(f"KV page {top} is past the pool's {self.limit} pages")
        size = max(self.pages, 1)
        while size <= top:
            size *= 2
        if self.limit is not None and 4 * size >= 3 * self.limit:
            size = self.limit  # not 512 pages now and 513 (the scratch page) next time
        for store in (self.keys, self.values):
            for layer, old in store.items():
                grown = mx.zeros((old.shape[0], size, PAGE, old.shape[-1]), old.dtype)
                grown[:, :self.pages] = old
                store[layer] = grown
        self.pages = size
        # Copied now, the old arrays given back at once: MLX's buffer cache would keep them,
        # and no later array has their size.
        before_host_sync()
        mx.eval(self.arrays())
        mx.clear_cache()

    def arrays(self) -> list[mx.array]:
        return [a for store in (self.keys, self.values) for a in store.values()]

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def budget_pages(self) -> int | None:
        """Pages the scheduler may hand out (the scratch page not among them)."""
        return None if self.limit is None else self.limit - 1

    def held(self) -> dict[str, float]:
        """What the runner holds of the pool now, for its logs: pages and MiB."""
        return {"kv_pool_pages": self.pages, "kv_pool_mib": round(self.nbytes / 2**20, 1)}

    def index(self, slots: np.ndarray, kv_heads: int) -> mx.array:
        """[len(slots) x kv_heads] int32: where token i's head h goes in a layer's array seen
        flat as [kv_heads x pages x PAGE, dim], in the order of [tokens, kv_heads] rows."""
        heads = np.arange(kv_heads, dtype=np.int64)[None] * (self.pages * PAGE)
        return mx.array((heads + slots.astype(np.int64)[:, None]).reshape(-1).astype(np.int32))

    def write(self, layer: int, index: mx.array, keys: mx.array, values: mx.array) -> None:
        """keys/values [tokens, kv_heads, 1, dim] to the flat `index` (index())."""
        write = pool_writer.get()
        k_pool, v_pool = self.keys[layer], self.values[layer]
        if (write is not None and keys.dtype == values.dtype == k_pool.dtype == v_pool.dtype
                and keys.shape[2] == values.shape[2] == 1):
            in_place = pool_in_place.get()
            self.keys[layer] = write(k_pool, index, keys, in_place=in_place)
            self.values[layer] = write(v_pool, index, values, in_place=in_place)
            return
        written = []  # one scatter per array seen flat, in place where MLX can donate it
        for pool, new in ((k_pool, keys), (v_pool, values)):
            flat = pool.reshape(-1, pool.shape[-1])
            flat[index] = new.reshape(-1, new.shape[-1]).astype(pool.dtype)
            written.append(flat.reshape(pool.shape))
        self.keys[layer], self.values[layer] = written

    def copy(self, src: list[int], dst: list[int]) -> None:
        """Every layer's K and V of slots `src` into slots `dst` (a prefix hit's partial page)."""
        if not src:
            return
        self.ensure(max(max(src), max(dst)) // PAGE)
        pages, at = np.asarray(src) // PAGE, np.asarray(src) % PAGE
        read_p, read_at = mx.array(pages.astype(np.int32)), mx.array(at.astype(np.int32))
        into: dict[int, mx.array] = {}  # kv_heads -> the write index, made once
        for layer in self.layers:
            k, v = self.keys[layer], self.values[layer]
            if k.shape[0] not in into:
                into[k.shape[0]] = self.index(np.asarray(dst), k.shape[0])
            # [kv_heads, n, dim] -> [n, kv_heads, 1, dim], as the writes take them
            got_k = k[:, read_p, read_at].transpose(1, 0, 2)[:, :, None]
            got_v = v[:, read_p, read_at].transpose(1, 0, 2)[:, :, None]
            self.write(layer, into[k.shape[0]], got_k, got_v)


def gather(pool: mx.array, table: mx.array) -> mx.array:
    """The pages of each table row laid end to end: [rows, kv_heads, pages x PAGE, dim]."""
    n, most = table.shape
    got = pool[:, table]  # [kv_heads, n, most, PAGE, dim]
    return got.transpose(1, 0, 2, 3, 4).reshape(n, pool.shape[0], most * PAGE, pool.shape[3])


def slots_of(pages: list[int], start: int, end: int) -> np.ndarray:
    """The slots of positions [start, end) of a row with this page table."""
    pos = np.arange(start, end, dtype=np.int64)
    return np.asarray(pages, dtype=np.int64)[pos // PAGE] * PAGE + pos % PAGE


class ChunkPlan:
    """Where a prompt's chunk goes in the pool: its write index and the row's page table up to
    its end, made once for every layer of the model (each layer's chunk covers the same
    positions), not once per layer."""

    def __init__(self, store: KvPages, pages: list[int]):
        self.store, self.pages = store, pages
        self._key: tuple[int, ...] | None = None
        self._made: tuple[mx.array, mx.array] = None  # type: ignore[assignment]

    def at(self, start: int, end: int, kv_heads: int) -> tuple[mx.array, mx.array]:
        """(the write index of positions [start, end), the table of their pages [1, n])."""
        key = (start, end, kv_heads, self.store.pages)
        if key != self._key:
            used = -(-end // PAGE)
            if used > len(self.pages):
                raise PoolFull(f"a prompt chunk up to position {end} of a row with "
                               f"{len(self.pages)} pages")
            self._made = (self.store.index(slots_of(self.pages, start, end), kv_heads),
                          mx.array([self.pages[:used]], dtype=mx.int32))
            self._key = key
        return self._made


class PromptKV(KVCache):
    """One full-attention layer of a prompt being prefilled, as the model's attention sees an
    mlx-lm KVCache: each chunk's K and V go straight into the row's pages, and the chunk
    attends over the row's pages gathered (its cached prefix, shared with the tree, among
    them). `pages` is the row's page table itself (rows.py), which PAGES ops extend; `plan`
    the chunk plan the prompt's layers share (one of their own where none is given)."""

    def __init__(self, store: KvPages, layer: int, pages: list[int], offset: int = 0,
                 plan: ChunkPlan | None = None):
        super().__init__()
        self.store, self.layer, self.pages, self.offset = store, layer, pages, offset
        self.plan = plan or ChunkPlan(store, pages)

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values [1, kv_heads, n, dim]: into positions [offset, offset + n)."""
        start, end = self.offset, self.offset + keys.shape[2]
        index, table = self.plan.at(start, end, keys.shape[1])
        self.store.write(self.layer, index, keys[0].transpose(1, 0, 2)[:, :, None],
                         values[0].transpose(1, 0, 2)[:, :, None])
        self.offset = end
        # Not kept (keys stays None): held, the gathered copies would be the very second
        # copy of a prompt's KV that the pool exists to do without.
        return (gather(self.store.keys[self.layer], table)[..., :end, :],
                gather(self.store.values[self.layer], table)[..., :end, :])

    @property
    def state(self) -> tuple[mx.array, mx.array]:
        return self.store.keys[self.layer], self.store.values[self.layer]

    @state.setter
    def state(self, v: Any) -> None:
        raise ValueError("a prompt's paged KV is the pool's: it is not set from outside")
