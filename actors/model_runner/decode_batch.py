"""The decode batch: every decoding row's caches, one batched cache per layer, laid out by
position (DESIGN section 4's decode batch, in a layout the runner owns).

Why not mlx-lm's BatchKVCache: it keeps rows left padded to a common end, so a row that leaves
(filter, extract) or joins (extend) copies the KV of every other row, and a long request
finishing made one step cost 0.6-0.9 s where a decode step costs ~70 ms. Here a row has a
position for as long as it holds KV:
- A full-attention layer's K and V live in `BatchedKV`: [positions, kv_heads, capacity, dim],
  each row from column 0, its own length, new tokens written at each row's own column.
- A recurrent layer's state lives in `BatchedStates`: one [positions, ...] array per part.
- Any other cache (sliding windows) stays mlx-lm's merged batch cache; such a model keeps no
  holes (the positions compact at once), as before.
A row that leaves becomes a hole: nothing is copied, the hole still runs in the forward (its
input is the padding row's token, its output is dropped) and costs one more row of a skinny
matmul. A joining row fills the lowest hole, so joins write only their own KV. The positions
compact (one gather of the rows that remain) only when holes are more than half of them, and
trailing holes are dropped at once.

A row that stops decoding but is not released (finished while a step was in flight, or being
retracted) is parked: it keeps its position and its KV, which a KV save may still read; the
forward writes its scratch column (its length, past its data) and never advances it.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import ArraysCache, KVCache, RotatingKVCache

from actors.model_runner.pipeline import before_host_sync

COLUMNS = 256  # K/V capacity grows in steps of this many positions


class Positions:
    """What the layers of one decode forward share: how many positions run (`n`) and each
    position's length (tokens of KV before this step), known on the host, so no layer reads
    anything back. `prepare` turns them into the forward's arrays once per step."""

    def __init__(self):
        self.n = 0
        self.lengths = np.zeros(0, np.int32)
        self.offset: mx.array | None = None  # [n] RoPE offsets: where each row's token goes
        self.at: tuple[mx.array, mx.array] | None = None  # ([n, 1] rows, [n, 1] columns) written
        self.mask: mx.array | None = None  # [n, 1, 1, width] keys each row attends to
        self.keys_per_row: mx.array | None = None  # [n] int32: the same as counts (the kernel's)
        self.width = 0  # columns the forward reads: the longest length + 1

    def resize(self, n: int) -> None:
        if n > len(self.lengths):
            self.lengths = np.concatenate([self.lengths, np.zeros(n - len(self.lengths),
                                                                  np.int32)])
        self.n = n

    def prepare(self) -> None:
        lengths = self.lengths[:self.n]
        self.width = int(lengths.max(initial=0)) + 1
        self.offset = mx.array(lengths)
        self.at = (mx.arange(self.n)[:, None], self.offset[:, None])  # once, for every layer
        self.mask = mx.array(np.arange(self.width)[None] <= lengths[:, None])[:, None, None, :]
        self.keys_per_row = mx.array(lengths + 1)


class BatchedKV:
    """One full-attention layer's K and V for the decode batch; what the model's attention
    calls (`offset`, `update_and_fetch`, `make_mask`) as it calls mlx-lm's caches."""

    def __init__(self, positions: Positions):
        self.positions = positions
        self.keys: mx.array | None = None  # [capacity rows, kv_heads, columns, dim]
        self.values: mx.array | None = None

    @property
    def offset(self) -> mx.array:
        return self.positions.offset

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (self.keys, self.values) if a is not None]

    def make_mask(self, n: int, return_array: bool = False, **_: Any) -> mx.array:
        if n != 1:
            raise ValueError(f"the decode batch runs one token per row, not {n}")
        return self.positions.mask

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """keys/values [n, kv_heads, 1, dim]: each row's new token at its own column."""
        p = self.positions
        self.reserve(keys, values, p.n, p.width)
        # One scatter per array, in place (the old buffer is donated): rows past n are spare
        # capacity and are not written.
        rows, cols = p.at
        heads = mx.arange(keys.shape[1])[None]
        self.keys[rows, heads, cols, :] = keys[:, :, 0, :]
        self.values[rows, heads, cols, :] = values[:, :, 0, :]
        return self.keys[:p.n, :, :p.width, :], self.values[:p.n, :, :p.width, :]

    def reserve(self, like_k: mx.array, like_v: mx.array, rows: int, columns: int) -> None:
        """Room for `rows` positions of `columns` tokens: grows (copying what is held) by
        doubling the rows and by COLUMNS-sized steps of columns."""
        if self.keys is not None and self.keys.shape[0] >= rows and self.keys.shape[2] >= columns:
            return
        have_rows, have_cols = (0, 0) if self.keys is None else (self.keys.shape[0],
                                                                  self.keys.shape[2])
        new_rows = max(have_rows, 1)
        while new_rows < rows:
            new_rows *= 2
        new_cols = max(have_cols, -(-columns // COLUMNS) * COLUMNS)
        grown = []
        for old, like in ((self.keys, like_k), (self.values, like_v)):
            a = mx.zeros((new_rows, like.shape[1], new_cols, like.shape[3]), like.dtype)
            if old is not None:
                a[:have_rows, :, :have_cols, :] = old
            grown.append(a)
        self.keys, self.values = grown

    def fill(self, at: int, cache: KVCache, length: int) -> None:
        """A joining row's prompt KV into position `at`: a copy of that row only."""
        if cache.keys is None or length == 0:
            return
        self.reserve(cache.keys, cache.values, at + 1, length + 1)
        self.keys[at:at + 1, :, :length, :] = cache.keys[..., :length, :]
        self.values[at:at + 1, :, :length, :] = cache.values[..., :length, :]

    def compact(self, keep: list[int], columns: int) -> None:
        if self.keys is None:
            return
        index = mx.array(keep)
        width = -(-columns // COLUMNS) * COLUMNS
        self.keys = self.keys[index, :, :width, :]
        self.values = self.values[index, :, :width, :]


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

    def __init__(self):
        self.positions = Positions()
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

    def join(self, row: int, cache: list[Any]) -> None:
        """A row whose prompt is done joins with its per-layer prompt caches."""
        if self.caches is None:
            self.caches = [self._batched(c) for c in cache]
            self.holes_ok = not any(_is_mlx_batch(c) for c in self.caches)
        holes = [i for i, r in enumerate(self.slots) if r is None]
        at = holes[0] if holes else len(self.slots)
        if at == len(self.slots):
            self.slots.append(None)
            self.positions.resize(len(self.slots))
        length = _length(cache)
        for i, own in enumerate(cache):
            batched = self.caches[i]
            if isinstance(batched, BatchedKV):
                batched.fill(at, own, length)
            elif isinstance(batched, BatchedStates):
                batched.fill(at, own, len(self.slots))
            elif batched is None:  # mlx-lm's merged cache: rows are appended, never holes
                self.caches[i] = type(own).merge([own])
            else:
                batched.extend(type(own).merge([own]))
        self.slots[at] = row
        self.where[row] = at
        self.decoding.add(row)
        self.positions.lengths[at] = length

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
        self._tidy()

    # -- the forward ----------------------------------------------------------------------------

    def inputs(self, token_buf: mx.array) -> mx.array:
        """[positions, 1]: each row's future from token_buf; holes and parked rows read the
        padding row 0 (their outputs are dropped). Called once per decode forward, before it:
        it also prepares the positions' offsets and mask for the layers."""
        padded = [r if r is not None and r in self.decoding else 0 for r in self.slots]
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

    def kv_of(self, row: int) -> tuple[list[Any], int]:
        return self.caches, self.where[row]

    # -- holes ----------------------------------------------------------------------------------

    def _tidy(self) -> None:
        """Trailing holes go at once; the rest compact when they are more than half (or at
        once where a layer cannot hold holes)."""
        n = len(self.slots)
        while self.slots and self.slots[-1] is None:
            self.slots.pop()
        if not self.slots:
            self.__init__()  # empty: every buffer goes
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
                c.compact(keep, int(lengths.max(initial=0)) + 1)
            elif isinstance(c, BatchedStates):
                c.compact(keep)
            else:
                before_host_sync()
                c.filter(mx.array(keep))
        self.slots = [self.slots[i] for i in keep]
        self.where = {r: i for i, r in enumerate(self.slots)}
        self.positions.lengths = lengths.copy()
        self.positions.resize(len(self.slots))

    def _batched(self, cache: Any) -> Any:
        if isinstance(cache, KVCache) and not isinstance(cache, RotatingKVCache):
            return BatchedKV(self.positions)
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
