"""Runner memory addressed by the scheduler's ids: the KV pool (full-attention layers, one entry
per KV slot) and the state pool (recurrent layers, one entry per state slot), and `Pools`, the
one place a deferred op (protocol.messages.OpKind) is applied to them. Which layer is which:
layers.py; what each row holds between steps: rows.py.

The runner computes on fast working copies (mlx-lm caches per row and per decode batch); the
pools are the storage of record that prefix reuse goes through: KV is saved into slots when the
scheduler caches a prefix and loaded from slots on a prefix hit; recurrent state is written
through to its slot after every step, so a snapshot, a copy or a donation is exact.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from actors.model_runner.decode_batch import row_tokens
from actors.model_runner.layers import Layers
from actors.model_runner.rows import Rows, StepError
from protocol import messages as m
from protocol.codec import unpack_ids


SEGMENT = 4096  # KV slots per segment of the pool


class KvPool:
    """Per full-attention layer, K and V of one token per slot, in segments of SEGMENT slots
    ([SEGMENT, kv_heads, head_dim] each), allocated as the scheduler's slot ids reach them
    (low ids first) up to its capacity. Segments, not one array that doubles: growing never
    copies what is held, and a step that saves a long prompt faults in at most the fresh
    memory of the segments it opens (~10 us a page on this VM), not a doubled pool's (a 1.7 s
    step at 16,384 -> 32,768 slots of qwen3-small)."""

    def __init__(self, layers: list[int], capacity: int):
        self.layers, self.capacity = layers, capacity
        self.keys: dict[int, list[mx.array]] = {}
        self.values: dict[int, list[mx.array]] = {}

    def _open(self, layer: int, segments: int, like_k: mx.array, like_v: mx.array) -> None:
        for store, like in ((self.keys, like_k), (self.values, like_v)):
            held = store.setdefault(layer, [])
            while len(held) < segments:
                held.append(mx.zeros((SEGMENT, *like.shape[1:]), dtype=like.dtype))

    def locate(self, slots: list[int]) -> Located:
        """Where the slots are, worked out once for an op on every layer. ValueError for a slot
        past the capacity."""
        top = max(slots)
        if top >= self.capacity:
            raise ValueError(f"KV slot {top} is beyond the pool's capacity {self.capacity}")
        return Located(slots)

    def save(self, layer: int, where: Located, keys: mx.array, values: mx.array) -> None:
        """keys/values [tokens, kv_heads, head_dim] go to the located slots."""
        self._open(layer, where.segments, keys, values)
        for seg, rows, at in where.parts:
            for store, new in ((self.keys, keys), (self.values, values)):
                store[layer][seg][at] = new if rows is None else new[rows]

    def all_arrays(self) -> list[mx.array]:
        return [a for store in (self.keys, self.values) for held in store.values() for a in held]

    def load(self, layer: int, where: Located) -> tuple[mx.array, mx.array]:
        out = []
        for store in (self.keys, self.values):
            got = [store[layer][seg][at] for seg, _, at in where.parts]
            # Segment by segment, then back into the slots' order.
            out.append(got[0] if len(got) == 1 else mx.concatenate(got)[where.order])
        return out[0], out[1]


class Located:
    """Slots by segment: per segment they touch, (segment, their positions in the list, their
    offsets in it); positions None when one segment holds them all. `order` puts what is
    read segment by segment back into the list's order."""

    def __init__(self, slots: list[int]):
        ids = np.asarray(slots, dtype=np.int64)
        segs = ids // SEGMENT
        self.segments = int(segs.max()) + 1
        self.order: mx.array | None = None
        if (segs == segs[0]).all():
            self.parts = [(int(segs[0]), None, mx.array((ids % SEGMENT).astype(np.int32)))]
            return
        self.parts, read = [], []
        for seg in np.unique(segs):
            rows = np.flatnonzero(segs == seg)
            read.append(rows)
            self.parts.append((int(seg), mx.array(rows.astype(np.int32)),
                               mx.array((ids[rows] % SEGMENT).astype(np.int32))))
        self.order = mx.array(np.argsort(np.concatenate(read), kind="stable").astype(np.int32))


class StatePool:
    """Per linear layer, the arrays of its recurrent state (e.g. conv window and SSM state),
    one entry per state slot. Shapes come from a probe forward at load time."""

    def __init__(self, shapes: dict[int, list[tuple[tuple[int, ...], Any]]], capacity: int):
        self.capacity = capacity
        self.arrays = {layer: [mx.zeros((capacity, *shape), dtype=dtype) for shape, dtype in parts]
                       for layer, parts in shapes.items()}
        mx.eval(list(self.arrays.values()))

    def clear(self, slot: int) -> None:
        for parts in self.arrays.values():
            for a in parts:
                a[slot] = 0

    def copy(self, src: int, dst: int) -> None:
        for parts in self.arrays.values():
            for a in parts:
                a[dst] = a[src]

    def read(self, layer: int, slots: list[int]) -> list[mx.array]:
        index = mx.array(slots)
        return [a[index] for a in self.arrays[layer]]

    def all_arrays(self) -> list[mx.array]:
        return [a for parts in self.arrays.values() for a in parts]

    def write(self, layer: int, slots: list[int], values: list[mx.array]) -> None:
        index = mx.array(slots)
        for a, v in zip(self.arrays[layer], values):
            a[index] = v


class Pools:
    """Both pools (either may be missing: no KV slots configured, or no recurrent layer) and the
    scheduler's ops on them, applied in batch order before the step's forward (DESIGN
    section 5). An op the runner cannot carry out is a StepError: the scheduler sent it."""

    def __init__(self, layers: Layers, kv: KvPool | None, states: StatePool | None):
        self.layers, self.kv, self.states = layers, kv, states

    def apply(self, op: m.Op, rows: Rows) -> None:
        match op.kind:
            case m.OpKind.CLEAR:
                self._need(self.states, "state").clear(op.dst)
            case m.OpKind.COPY | m.OpKind.SNAPSHOT:
                self._need(self.states, "state").copy(op.src, op.dst)
            case m.OpKind.KV_SAVE:
                self._check_restorable("save")
                self._save_kv(rows, op.dst, op.start, unpack_ids(op.slots))
            case m.OpKind.KV_LOAD:
                self._check_restorable("load")
                rows.load_later(op.dst, unpack_ids(op.slots))
            case m.OpKind.DONATE:
                rows.donate(op.dst, op.src)
            case _:
                raise StepError(f"unknown op kind {op.kind}")

    def _check_restorable(self, what: str) -> None:
        """A sliding-window layer keeps only its window, so the pool cannot give a prefix of
        it back: the scheduler runs such a model with the prefix cache off."""
        unpooled = self.layers.unpooled
        if unpooled:
            kinds = sorted({self.layers.kinds[i] for i in unpooled})
            raise StepError(f"KV {what}, but layers {unpooled} ({', '.join(kinds)}) "
                            "cannot be restored from the KV pool")

    @staticmethod
    def _need(pool: Any, what: str) -> Any:
        if pool is None:
            raise StepError(f"a {what} op, but this runner has no {what} pool")
        return pool

    def _save_kv(self, rows: Rows, row: int, start: int, slots: list[int]) -> None:
        """The row's KV at positions [start, start + len(slots)) into the pool's slots."""
        pool = self._need(self.kv, "KV")
        caches, index = rows.kv_of(row)
        end = start + len(slots)
        where = pool.locate(slots)
        for layer in self.layers.full:
            keys, values = row_tokens(caches[layer], index, start, end)
            pool.save(layer, where, keys, values)

    def restore(self, cache: list[Any], kv_slots: list[int], state_slot: int | None) -> None:
        """Fill a new prompt's fresh caches: the cached prefix's KV from the KV slots (if the
        scheduler found a prefix) and the recurrent state from the row's state slot (cleared
        or copied by this step's ops)."""
        if kv_slots:
            pool = self._need(self.kv, "KV")
            where = pool.locate(kv_slots)
            for layer in self.layers.full:
                keys, values = pool.load(layer, where)
                c = cache[layer]
                c.keys = keys.transpose(1, 0, 2)[None]
                c.values = values.transpose(1, 0, 2)[None]
                c.offset = len(kv_slots)
        if self.states is not None and state_slot is not None:
            for layer in self.layers.linear:
                cache[layer].cache = self.states.read(layer, [state_slot])

    def write_states(self, slots: list[int] | None, caches: list[Any],
                     at: mx.array | None = None) -> None:
        """Write the recurrent state through to the rows' state slots, so a snapshot, a copy
        or a donation the scheduler orders later sees exactly the state after this step.
        slots None: the rows keep no state slot (prefix caching off), nothing to keep.
        at: the rows' positions in the caches (None: the caches hold these rows only)."""
        if self.states is None or slots is None:
            return
        for layer in self.layers.linear:
            parts = caches[layer].cache
            self.states.write(layer, slots, parts if at is None else [a[at] for a in parts])

    def arrays(self) -> list[mx.array]:
        """Every pool array: pool writes are lazy scatters, evaluated with each step."""
        pools = [p for p in (self.kv, self.states) if p is not None]
        return [a for p in pools for a in p.all_arrays()]
