"""Runner memory addressed by the scheduler's ids: the KV pool (full-attention layers, one entry
per KV slot) and the state pool (recurrent layers and sliding windows, one entry per state
slot), and `Pools`, the
one place a deferred op (protocol.messages.OpKind) is applied to them. Which layer is which:
layers.py; what each row holds between steps: rows.py.

The runner computes on fast working copies (mlx-lm caches per row and per decode batch); the
pools are the storage of record that prefix reuse goes through: KV is saved into slots when the
scheduler caches a prefix and loaded from slots on a prefix hit; recurrent state is read out of
a row's caches only when an op keeps it (a snapshot, a copy, a donation, a row that parks), so
a step that needs none writes nothing.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import numpy as np

from actors.model_runner.decode_batch import row_tokens
from actors.model_runner.layers import Layers
from actors.model_runner.rows import Rows, StepError
from actors.model_runner.windows import restore_window
from protocol import messages as m
from protocol.codec import unpack_ids


SEGMENT = 4096  # KV slots per segment of the pool
HEAD_INPUT = -1  # a state value's key (beside the layers') for the LM head's input kept there


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

    def open_first(self, cache: list[Any]) -> None:
        """Every layer's first segment, allocated and faulted in now (at startup), shaped like
        the K and V of `cache` (a prompt's per-layer caches after one token): else the first
        request to end pays for it in a client's step (7 ms on qwen3_5-small's two attention
        layers)."""
        for layer in self.layers:
            self._open(layer, 1, *row_tokens(cache[layer], 0, 0, 1))
        mx.eval(self.all_arrays())

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
    """Per state slot, what the scheduler keeps there: the recurrent state of every linear
    layer (layer -> its arrays, conv window and SSM state) and the window of every sliding-
    window layer (layer -> [keys, values], windows.py), or nothing (a fresh start);
    at a prompt's end also the LM head's input at its last token (key HEAD_INPUT: [input] or
    [input, the greedy head's token for it])
    A slot a row holds live is not written to: its state is the row's caches, read only when
    an op needs it (`Pools.state_of`), so a step costs nothing here.

    Values are immutable MLX arrays, so a copy shares them. One preallocated array per layer,
    written by scatters, cost a whole copy of it whenever a step both read and wrote it (a
    prefix hit's one-token prefill on qwen3_5-small: 56 ms at 64 slots, 149 ms at 256,
    against 22 ms now)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.held: dict[int, dict[int, list[mx.array | None]]] = {}
        self.fresh: list[mx.array] = []  # lazy reads taken this step, evaluated with it

    def check(self, *slots: int) -> None:
        for slot in slots:
            if not 0 <= slot < self.capacity:
                raise StepError(f"state slot {slot} is outside the pool (0..{self.capacity - 1})")

    def put(self, slot: int, value: dict[int, list[mx.array | None]] | None) -> None:
        self.check(slot)
        if value is None:
            self.held.pop(slot, None)
        else:
            self.held[slot] = value

    def take(self, slot: int) -> dict[int, list[mx.array | None]] | None:
        """A new prompt starts from the slot's value; from now on its row holds it live."""
        return self.held.pop(slot, None)

    def all_arrays(self) -> list[mx.array]:
        """The reads taken since the last step (handed over once: a value is evaluated)."""
        fresh, self.fresh = self.fresh, []
        return fresh


class Pools:
    """Both pools (either may be missing: no KV slots configured, or no recurrent layer) and the
    scheduler's ops on them, applied in batch order before the step's forward
    (docs/architecture.md, section 6). An op the runner cannot carry out is a StepError: the
    scheduler sent it."""

    def __init__(self, layers: Layers, kv: KvPool | None, states: StatePool | None):
        self.layers, self.kv, self.states = layers, kv, states

    def apply(self, op: m.Op, rows: Rows) -> None:
        match op.kind:
            case m.OpKind.CLEAR:
                self._need(self.states, "state").put(op.dst, None)
            case m.OpKind.COPY | m.OpKind.SNAPSHOT:
                value = self.state_of(op.src, rows)
                self._check_head_input(op, value)
                self._need(self.states, "state").put(op.dst, value)
            case m.OpKind.KV_SAVE:
                self._check_restorable("save")
                self._save_kv(rows, op.dst, op.start, unpack_ids(op.slots))
            case m.OpKind.KV_LOAD:
                self._check_restorable("load")
                rows.load_later(op.dst, unpack_ids(op.slots))
            case m.OpKind.DONATE:
                # A runner with no state pool keeps nothing (the row's slot is only a name).
                value = None if self.states is None else self.state_of(op.src, rows)
                self._check_head_input(op, value)
                rows.donate(op.dst, op.src)
                if self.states is not None:
                    self.states.put(op.src, value)
            case _:
                raise StepError(f"unknown op kind {op.kind}")

    @staticmethod
    def _check_head_input(op: m.Op, value: dict[int, list[mx.array]] | None) -> None:
        """The scheduler marks a node as able to sample (radix.py) from this op's flag alone:
        the value must then have what it samples from."""
        if op.head_input and (value is None or HEAD_INPUT not in value):
            raise StepError(f"{op.kind.name} of state slot {op.src} keeps the head's input, "
                            "but its row has not sampled where its state is")

    def _check_restorable(self, what: str) -> None:
        """Layers of a kind neither pool keeps cannot be given a prefix back: the scheduler
        runs such a model with the prefix cache off."""
        self._need(self.kv, "KV")
        unpooled = self.layers.unpooled
        if unpooled:
            kinds = sorted({self.layers.kinds[i] for i in unpooled})
            raise StepError(f"KV {what}, but layers {unpooled} ({', '.join(kinds)}) "
                            "cannot be restored from the KV pool")
        if self.layers.stateful and self.states is None:
            raise StepError(f"KV {what}, but layers {self.layers.stateful} resume from a state "
                            "slot and this runner has no state pool")

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

    def restore(self, cache: list[Any], kv_slots: list[int],
                state_slot: int | None) -> list[mx.array] | None:
        """Fill a new prompt's fresh caches: the cached prefix's KV from the KV slots (if the
        scheduler found a prefix) and the recurrent state from the row's state slot (cleared
        or copied by this step's ops). Returns what the state kept at HEAD_INPUT, if any."""
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
            value = self.states.take(state_slot)
            for layer in self.layers.linear if value else ():
                cache[layer].cache = list(value[layer])
            for layer in self.layers.windows if value else ():
                restore_window(cache[layer], value[layer], len(kv_slots))
            if value and HEAD_INPUT in value:
                return value[HEAD_INPUT]
        return None

    def state_of(self, slot: int, rows: Rows) -> dict[int, list[mx.array | None]] | None:
        """What the slot holds now: for a slot a row holds live, the row's state after the
        last step it ran (read out of its caches, lazily); else the value kept there."""
        pool = self._need(self.states, "state")
        pool.check(slot)
        row = rows.holder(slot)
        got = None if row is None else self._live(row, rows)
        return pool.held.get(slot) if got is None else got

    def _live(self, row: int, rows: Rows) -> dict[int, list[mx.array | None]] | None:
        got = rows.live_states(row, self.layers)
        head_input, greedy = (None, None) if got is None else rows.head_input_of(row)
        if head_input is not None:
            got[HEAD_INPUT] = [head_input] if greedy is None else [head_input, greedy]
        if got is not None:
            self.states.fresh += [a for parts in got.values() for a in parts if a is not None]
        return got

    def park(self, parked: list[int], rows: Rows) -> None:
        """Rows that stop decoding keep their position in the decode batch, where the forward
        goes on changing their state: what they hold live is kept now."""
        if self.states is None:
            return
        for row in parked:
            slot = rows.state.get(row)
            if slot is not None:
                self.states.put(slot, self._live(row, rows))

    def arrays(self) -> list[mx.array]:
        """Every KV pool array and the states read this step: pool writes and reads are lazy,
        evaluated with each step, or every step would chain onto the last."""
        pools = [p for p in (self.kv, self.states) if p is not None]
        return [a for p in pools for a in p.all_arrays()]
