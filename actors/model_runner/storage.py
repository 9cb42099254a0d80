"""Runner memory addressed by the scheduler's ids: the KV pool (full-attention layers, one entry
per KV slot) and the state pool (recurrent layers, one entry per state slot). Which layer is
which: layers.py.

The runner computes on fast working copies (mlx-lm caches per row and per decode batch); the
pools are the storage of record that prefix reuse goes through: KV is saved into slots when the
scheduler caches a prefix and loaded from slots on a prefix hit; recurrent state is written
through to its slot after every step, so a snapshot, a copy or a donation is exact.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx


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
