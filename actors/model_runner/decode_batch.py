"""The decode batch: every decoding row's caches, one batched cache per layer, laid out by
position, in a layout the runner owns (docs/architecture.md, section 8).

Why not mlx-lm's BatchKVCache: it keeps rows left padded to a common end, so a row that leaves
(filter, extract) or joins (extend) copies the KV of every other row, and it holds rows x the
longest context. Here a row has a position for as long as it holds KV:
- A full-attention layer's K and V are the one pool's (kv_pages.py), read by `BatchedKV`
  through each position's page table, the scheduler's pages of its row. A joining row's
  prompt is there already (its chunks wrote it): nothing moves when rows come and go. The
  decode attention kernel reads the pages through the table; MLX's attention gets them
  gathered into [positions, kv_heads, columns, dim] (a copy per layer and step, lazily: never
  built where the kernel runs).
- A recurrent layer's state lives in `BatchedStates`: one [positions, ...] array per part.
- Any other cache (sliding windows) stays mlx-lm's merged batch cache; such a model keeps no
  holes (the positions compact at once), as before.
A row that leaves becomes a hole: nothing is copied, the hole still runs in the forward (its
input is the padding row's token, its output is dropped) and costs one more row of a skinny
matmul. A joining row fills the lowest hole. The positions compact (one gather of the recurrent
states; the page tables are reordered on the host) only when holes are more than half of them,
and trailing holes are dropped at once.

A row that stops decoding but is not released (finished while a step was in flight, or being
retracted) is parked: it keeps its position and its pages until the scheduler releases it.
Holes and parked rows write this step's K/V into the scratch page 0 and attend to that one key:
their outputs are dropped, their pages never change.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from actors.model_runner.kv_pages import PAGE, KvPages, PoolFull, gather, slots_of
from actors.model_runner.pipeline import before_host_sync
from actors.model_runner.windows import row_window

class Positions:
    """What the layers of one decode forward share: how many positions run (`n`), each
    position's length (tokens of KV before this step) and page table (its row's, rows.py),
    and which positions decode, known on the host, so no layer reads anything back. `prepare`
    turns them into the forward's arrays once per step."""

    def __init__(self, store: KvPages):
        self.store = store
        # The table's width rounded up to a power of two pages: while the decode forward is
        # compiled (compiled_decode.py), a new width is a new trace. The runner's setting: it
        # outlives the buffers.
        self.round_pages = False
        self.clear()

    def clear(self) -> None:
        """Every buffer back to empty (the last row left)."""
        self.n = 0
        self.lengths = np.zeros(0, np.int32)
        self.live = np.zeros(0, bool)  # the position decodes in this step
        self.pages: list[list[int]] = []  # position -> its row's page table (the same list)
        self.offset: mx.array | None = None  # [n] RoPE offsets: where each row's token goes
        self._at = np.zeros(0, np.int64)  # [n] each row's written token: page * PAGE + slot
        self._writes: dict[int, mx.array] = {}  # kv_heads -> this step's flat write index
        self.table: mx.array | None = None  # [n, max pages] int32: each position's pages
        self.mask: mx.array | None = None  # [n, 1, 1, width] keys each row attends to
        self.keys_per_row: mx.array | None = None  # [n] int32: the same as counts (the kernel's)
        self.width = 0  # columns of the gathered K/V: max pages x PAGE

    def resize(self, n: int) -> None:
        grow = n - len(self.lengths)
        if grow > 0:
            self.lengths = np.concatenate([self.lengths, np.zeros(grow, np.int32)])
            self.live = np.concatenate([self.live, np.zeros(grow, bool)])
            self.pages += [[] for _ in range(grow)]
        self.n = n

    def writes(self, kv_heads: int) -> mx.array:
        """[n x kv_heads] int32: where this step's token of row b, head h goes in a pool seen
        flat (KvPages.index), in the order of the new keys reshaped to [n x kv_heads, dim].
        Made once per step for every layer."""
        if kv_heads not in self._writes:
            self._writes[kv_heads] = self.store.index(self._at, kv_heads)
        return self._writes[kv_heads]

    def replace_writes(self, writes: dict[int, mx.array]) -> None:
        """This step's write index per kv_heads, made elsewhere (a compiled forward's input)."""
        self._writes = writes

    # -- the forward ----------------------------------------------------------------------------

    def prepare(self) -> None:
        # Plain Python over the positions, the step's arrays made at the end: this runs on the
        # MLX thread every step, with a cache the step's weights have just swept, where each
        # small numpy call costs several microseconds. qwen3-small-4bit, runner core driven
        # step by step: 185-200 -> 140-175 us at one row, 510 -> 330 us at 16 rows.
        n = self.n
        lengths, live = self.lengths[:n].tolist(), self.live[:n].tolist()
        at_written = [0] * n  # holes and parked rows write into the scratch page
        counts = [1] * n
        most = 1
        for at in range(n):
            if not live[at]:
                continue
            length = lengths[at]
            pages = self.pages[at]
            if len(pages) * PAGE <= length:  # the scheduler sends a page before it is needed
                raise PoolFull(f"a decode row at position {length} has {len(pages)} pages")
            at_written[at] = pages[length // PAGE] * PAGE + length % PAGE
            counts[at] = length + 1
            most = max(most, length // PAGE + 1)
        if self.round_pages:  # the columns past a row's pages are the scratch page, masked
            most = 1 << (most - 1).bit_length()
        table = []
        for at in range(n):
            pages = self.pages[at][:most] if live[at] else []
            table.append(pages + [0] * (most - len(pages)))
        self.width = most * PAGE
        self.offset = mx.array(self.lengths[:n])
        self._at = np.array(at_written, np.int64)
        self._writes = {}
        self.table = mx.array(np.array(table, np.int32).reshape(n, most))  # n may be 0
        self.mask = mx.array(np.arange(self.width)[None] < np.array(counts)[:, None])[
            :, None, None, :]
        self.keys_per_row = mx.array(counts, dtype=mx.int32)


class BatchedKV:
    """One full-attention layer of the decode batch: what the model's attention calls
    (`offset`, `update_and_fetch`, `make_mask`) as it calls mlx-lm's caches. Its K and V are
    the layer's arrays of the one pool (kv_pages.py), read through the positions' tables."""

    def __init__(self, positions: Positions, layer: int):
        self.positions, self.layer = positions, layer
        # What update_and_fetch last returned: the attention kernel stands in only for
        # attention over exactly these (DeepSeek's latent attention stores other things as K
        # and V and attends over them with a mask of its own).
        self.fetched: tuple[mx.array, mx.array] | None = None

    @property
    def keys(self) -> mx.array:
        return self.positions.store.keys[self.layer]

    @keys.setter
    def keys(self, a: mx.array) -> None:
        self.positions.store.keys[self.layer] = a

    @property
    def values(self) -> mx.array:
        return self.positions.store.values[self.layer]

    @values.setter
    def values(self, a: mx.array) -> None:
        self.positions.store.values[self.layer] = a

    @property
    def offset(self) -> mx.array:
        return self.positions.offset

    @property
    def state(self) -> list[mx.array]:
        return [self.keys, self.values]

    def make_mask(self, n: int, return_array: bool = False, **_: Any) -> mx.array:
        if n != 1:
            raise ValueError(f"the decode batch runs one token per row, not {n}")
        return self.positions.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values [n, kv_heads, 1, dim]: each row's new token into its page. Returns the
        rows' pages gathered as [n, kv_heads, width, dim] for MLX's attention (lazy: the
        kernel reads the pool through the page table and never evaluates them)."""
        p = self.positions
        p.store.write(self.layer, p.writes(keys.shape[1]), keys, values)
        self.fetched = gather(self.keys, p.table), gather(self.values, p.table)
        return self.fetched


class BatchedStates(ArraysCache):
    """One recurrent layer's state for the decode batch: one [positions, ...] array per part
    (conv window, SSM state). An ArraysCache without padding or lengths, because model code
    tells the layer kinds apart by isinstance; what it adds is how rows come and go."""

    def fill(self, at: int, cache: ArraysCache, n: int) -> None:
        """The joining row's state into position `at` of `n` positions (one past the end:
        the arrays grow by one row)."""
        for i, part in enumerate(cache.cache):
            have = self.cache[i]
            if have is None and part is None:
                continue  # no row has this part yet: the model starts it as zeros
            like = have if part is None else part
            if have is None:
                have = mx.zeros((n, *like.shape[1:]), like.dtype)
            elif have.shape[0] < n:
                pad = mx.zeros((n - have.shape[0], *like.shape[1:]), like.dtype)
                have = mx.concatenate([have, pad])
            # A fresh part is zeros, as the model starts one: not the hole's last occupant's.
            have[at:at + 1] = 0 if part is None else part
            self.cache[i] = have

    def trim(self, n: int) -> None:
        self.cache = [None if a is None else a[:n] for a in self.cache]

    def compact(self, keep: list[int]) -> None:
        index = mx.array(keep)
        self.cache = [None if a is None else a[index] for a in self.cache]


class DecodeBatch:
    """The positions and the per-layer batched caches. `rows` are the rows that decode, in
    position order: the decode forward's output order once `live_index` picks them out."""

    def __init__(self, store: KvPages):
        self.positions = Positions(store)
        self._clear()

    def _clear(self) -> None:
        """Every buffer goes (the last row left); the positions' setting stays."""
        self.positions.clear()
        self.slots: list[int | None] = []  # position -> its row, None where a hole is
        self.where: dict[int, int] = {}  # row -> its position (decoding or parked)
        self.decoding: set[int] = set()
        self.caches: list[Any] | None = None
        self.holes_ok = True  # False once a layer keeps mlx-lm's merged cache

    @property
    def rows(self) -> list[int]:
        return [r for r in self.slots if r is not None and r in self.decoding]

    def __len__(self) -> int:
        return len(self.slots)

    # -- rows in and out ------------------------------------------------------------------------

    def join(self, row: int, cache: list[Any], pages: list[int]) -> None:
        """A row whose prompt is done joins with its per-layer prompt caches and its page
        table (its full-attention layers' KV is in the pool already: nothing to copy)."""
        if self.caches is None:
            self.caches = [self._batched(i, c) for i, c in enumerate(cache)]
            self.holes_ok = not any(_is_mlx_batch(c) for c in self.caches)
        holes = [i for i, r in enumerate(self.slots) if r is None]
        at = holes[0] if holes else len(self.slots)
        if at == len(self.slots):
            self.slots.append(None)
            self.positions.resize(len(self.slots))
        length = _length(cache)
        self.positions.pages[at] = pages
        for i, own in enumerate(cache):
            batched = self.caches[i]
            if isinstance(batched, BatchedKV):
                continue
            if isinstance(batched, BatchedStates):
                batched.fill(at, own, len(self.slots))
            elif batched is None:  # mlx-lm's merged cache: rows are appended, never holes
                self.caches[i] = type(own).merge([own])
            else:
                batched.extend(type(own).merge([own]))
        self.slots[at] = row
        self.where[row] = at
        self.decoding.add(row)
        self.positions.lengths[at] = length

    def join_copy(self, row: int, cache: list[Any]) -> None:
        """A row from a plain mlx-lm prompt cache (calibration and benchmarks, outside the
        scheduler): its K and V copied into pages of its own, past every page in use."""
        length = _length(cache)
        if not length:
            raise ValueError("join_copy takes a prompt's caches after at least one token")
        store = self.positions.store
        first = 1 + max((max(p) for p in self.positions.pages if p), default=0)
        pages = list(range(first, first + length // PAGE + 1))
        store.ensure(pages[-1])
        slots = slots_of(pages, 0, length)
        for layer in store.layers:
            c = cache[layer]
            index = store.index(slots, c.keys.shape[1])
            store.write(layer, index, c.keys[0, :, :length].transpose(1, 0, 2)[:, :, None],
                        c.values[0, :, :length].transpose(1, 0, 2)[:, :, None])
        self.join(row, cache, pages)

    def keep(self, rows: list[int]) -> None:
        """These rows decode in this step; the others that decoded are parked."""
        self.decoding = set(rows)

    def release(self, rows: list[int]) -> None:
        """The rows are gone: their positions become holes."""
        for row in rows:
            at = self.where.pop(row, None)
            if at is None:
                continue
            self.decoding.discard(row)
            self.slots[at] = None
            self.positions.lengths[at] = 0
            self.positions.pages[at] = []
        self._tidy()

    # -- the forward ----------------------------------------------------------------------------

    def inputs(self, token_buf: mx.array) -> mx.array:
        """[positions, 1]: each row's future from token_buf; holes and parked rows read the
        padding row 0 (their outputs are dropped). Called once per decode forward, before it:
        it also prepares the positions' offsets and mask for the layers."""
        live = [r is not None and r in self.decoding for r in self.slots]
        padded = [r if ok else 0 for r, ok in zip(self.slots, live)]
        self.positions.live[:len(live)] = live
        self.positions.prepare()
        return token_buf[mx.array(padded)][:, None]

    def live_index(self) -> mx.array | None:
        """The decoding rows' positions, or None when every position decodes."""
        at = [i for i, r in enumerate(self.slots) if r is not None and r in self.decoding]
        return None if len(at) == len(self.slots) else mx.array(at)

    def advance(self) -> None:
        """After the forward: each decoding row holds one more token."""
        for row in self.decoding:
            self.positions.lengths[self.where[row]] += 1

    def states_of(self, row: int, layers: Any) -> dict[int, list[mx.array | None]]:
        """The row's recurrent states and windows (layers.py's Layers), copied out of the batch
        (a gather, not a view that would keep the whole batch's arrays alive)."""
        at = mx.array([self.where[row]])
        got = {i: [None if a is None else a[at] for a in self.caches[i].cache]
               for i in layers.linear}
        return got | {i: row_window(self.caches[i], self.where[row]) for i in layers.windows}

    # -- holes ----------------------------------------------------------------------------------

    def _tidy(self) -> None:
        """Trailing holes go at once; the rest compact when they are more than half (or at
        once where a layer cannot hold holes)."""
        n = len(self.slots)
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        if not self.slots:
            self._clear()
            return
        holes = self.slots.count(None)
        if holes and (not self.holes_ok or 2 * holes > len(self.slots)):
            self._compact()
        elif len(self.slots) < n:
            self._trim(len(self.slots))

    def _trim(self, n: int) -> None:
        self.positions.resize(n)
        for c in self.caches:
            if isinstance(c, BatchedStates):
                c.trim(n)
            elif _is_mlx_batch(c):
                before_host_sync()  # mlx-lm's filter reads its paddings back
                c.filter(mx.arange(n))

    def _compact(self) -> None:
        keep = [i for i, r in enumerate(self.slots) if r is not None]
        lengths = self.positions.lengths[keep]
        for c in self.caches:
            if isinstance(c, BatchedKV):
                continue  # its pages stay where they are: only the page tables move
            if isinstance(c, BatchedStates):
                c.compact(keep)
            else:
                before_host_sync()
                c.filter(mx.array(keep))
        self.slots = [self.slots[i] for i in keep]
        self.where = {r: i for i, r in enumerate(self.slots)}
        p = self.positions
        p.lengths, p.live = lengths.copy(), p.live[keep]
        p.pages = [p.pages[i] for i in keep]
        p.resize(len(self.slots))

    def _batched(self, layer: int, cache: Any) -> Any:
        if isinstance(cache, KVCache) and not isinstance(cache, RotatingKVCache):
            return BatchedKV(self.positions, layer)
        if isinstance(cache, ArraysCache):
            return BatchedStates(len(cache.cache))
        return None  # mlx-lm's merged cache, made from the first joining row


def _is_mlx_batch(cache: Any) -> bool:
    return not isinstance(cache, (BatchedKV, BatchedStates))


def _length(cache: list[Any]) -> int:
    """The row's tokens so far, told by its first full-attention (or any attention) cache."""
    for c in cache:
        if isinstance(c, KVCache) or isinstance(c, RotatingKVCache):
            return int(c.offset)
    return 0


def standalone(cache: list[Any]) -> DecodeBatch:
    """A decode batch with a pool of its own for the full-attention layers of `cache` (a
    model's mlx-lm prompt caches after a prompt), for measuring outside the runner."""
    layers = [i for i, c in enumerate(cache)
              if isinstance(c, KVCache) and not isinstance(c, RotatingKVCache)]
    store = KvPages(layers)
    if layers:
        store.open(cache)
    return DecodeBatch(store)
