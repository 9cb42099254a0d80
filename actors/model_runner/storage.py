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

from actors.model_runner.decode_batch import row_tokens
from actors.model_runner.layers import Layers
from actors.model_runner.rows import Rows, StepError
from protocol import messages as m
from protocol.codec import unpack_ids


class KvPool:
    """Per full-attention layer, K and V of one token per slot: [slots, kv_heads, head_dim]. Grows
    by doubling up to the scheduler's capacity: slot ids are handed out low first."""

    def __init__(self, layers: list[int], capacity: int):
        self.layers, self.capacity = layers, capacity
        self.keys: dict[int, mx.array] = {}
        self.values: dict[int, mx.array] = {}

    def _grow(self, need: int, like_k: mx.array, like_v: mx.array, layer: int) -> None:
        size = max(self.keys[layer].shape[0] if layer in self.keys else 0, 256)
        while size < need:
            size *= 2
        size = min(size, self.capacity)
        if need > size:
            raise ValueError(f"KV slot {need - 1} is beyond the pool's capacity {self.capacity}")
        for store, like in ((self.keys, like_k), (self.values, like_v)):
            old = store.get(layer)
            shape = (size, *like.shape[1:])
            grown = mx.zeros(shape, dtype=like.dtype)
            if old is not None and old.shape[0]:
                grown[: old.shape[0]] = old
            store[layer] = grown

    def save(self, layer: int, slots: list[int], keys: mx.array, values: mx.array) -> None:
        """keys/values [tokens, kv_heads, head_dim] go to the given slots."""
        need = max(slots) + 1
        if layer not in self.keys or self.keys[layer].shape[0] < need:
            self._grow(need, keys, values, layer)
        index = mx.array(slots)
        self.keys[layer][index] = keys
        self.values[layer][index] = values

    def all_arrays(self) -> list[mx.array]:
        return [*self.keys.values(), *self.values.values()]

    def load(self, layer: int, slots: list[int]) -> tuple[mx.array, mx.array]:
        index = mx.array(slots)
        return self.keys[layer][index], self.values[layer][index]


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
        for layer in self.layers.full:
            keys, values = row_tokens(caches[layer], index, start, end)
            pool.save(layer, slots, keys, values)

    def restore(self, cache: list[Any], kv_slots: list[int], state_slot: int | None) -> None:
        """Fill a new prompt's fresh caches: the cached prefix's KV from the KV slots (if the
        scheduler found a prefix) and the recurrent state from the row's state slot (cleared
        or copied by this step's ops)."""
        if kv_slots:
            pool = self._need(self.kv, "KV")
            for layer in self.layers.full:
                keys, values = pool.load(layer, kv_slots)
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
