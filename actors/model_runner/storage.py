"""Runner memory addressed by the scheduler's ids: the one KV pool (full-attention layers, in
pages: kv_pages.py) and the state pool (recurrent layers and sliding windows, one entry per
state slot), and `Pools`, the one place a deferred op (protocol.messages.OpKind) is applied to
them. Which layer is which: layers.py; what each row holds between steps: rows.py.

Full-attention KV is written once, where the scheduler's pages put it, and a prefix hit reads
the tree's pages in place. Recurrent state is computed on working copies (each row's mlx-lm
caches, the decode batch's arrays) and read out of them only when an op keeps it (a snapshot,
a copy, a donation, a row that parks), so a step that needs none writes nothing.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from actors.model_runner.kv_pages import PAGE, ChunkPlan, KvPages, PromptKV
from actors.model_runner.layers import Layers
from actors.model_runner.rows import Rows, StepError
from actors.model_runner.windows import restore_window
from protocol import messages as m
from protocol.codec import unpack_ids


HEAD_INPUT = -1  # a state value's key (beside the layers') for the LM head's input kept there


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
    """The KV pool and the state pool (missing where no recurrent or sliding layer is) and
    the scheduler's ops on them, applied in batch order before the step's forward
    (docs/architecture.md, section 6). An op the runner cannot carry out is a StepError: the
    scheduler sent it."""

    def __init__(self, layers: Layers, kv: KvPages, states: StatePool | None):
        self.layers, self.kv, self.states = layers, kv, states

    def apply(self, op: m.Op, rows: Rows) -> None:
        match op.kind:
            case m.OpKind.CLEAR:
                self._need(self.states, "state").put(op.dst, None)
            case m.OpKind.COPY | m.OpKind.SNAPSHOT:
                value = self.state_of(op.src, rows)
                self._check_head_input(op, value)
                self._need(self.states, "state").put(op.dst, value)
            case m.OpKind.PAGES:
                pages = unpack_ids(op.slots)
                if pages and min(pages) < 1:
                    raise StepError(f"row {op.dst} is given page {min(pages)}: page 0 is the "
                                    "scratch page")
                if pages:
                    self.kv.ensure(max(pages))
                rows.set_pages(op.dst, op.start, pages)
            case m.OpKind.KV_COPY:
                ids = unpack_ids(op.slots)
                half = len(ids) // 2
                if len(ids) % 2 or min(ids, default=PAGE) < PAGE:
                    raise StepError(f"a KV copy of {len(ids)} slot ids, or into page 0")
                self.kv.copy(ids[:half], ids[half:])
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

    @staticmethod
    def _need(pool: Any, what: str) -> Any:
        if pool is None:
            raise StepError(f"a {what} op, but this runner has no {what} pool")
        return pool

    def restore(self, row: int, cache: list[Any], start: int, pages: list[int],
                state_slot: int | None) -> list[mx.array] | None:
        """Set up a new prompt's fresh caches at `start` (its cached prefix's length): the
        full-attention layers read and write the row's pages (the prefix's among them), the
        recurrent state and windows come from the row's state slot (cleared or copied by this
        step's ops). Returns what the state kept at HEAD_INPUT, if any."""
        if len(pages) * PAGE < start:
            raise StepError(f"row {row}: prompt starts at {start} with {len(pages)} pages")
        plan = ChunkPlan(self.kv, pages)
        for layer in self.layers.full:
            cache[layer] = PromptKV(self.kv, layer, pages, start, plan)
        if start and self.layers.unpooled:
            kinds = sorted({self.layers.kinds[i] for i in self.layers.unpooled})
            raise StepError(f"row {row} starts at {start}, but layers {self.layers.unpooled} "
                            f"({', '.join(kinds)}) cannot be given a prefix back")
        if self.states is None or state_slot is None:
            if start and self.layers.stateful:
                raise StepError(f"row {row} starts at {start}, but layers "
                                f"{self.layers.stateful} resume from a state slot and it has none")
            return None
        value = self.states.take(state_slot)
        for layer in self.layers.linear if value else ():
            cache[layer].cache = list(value[layer])
        for layer in self.layers.windows if value else ():
            restore_window(cache[layer], value[layer], start)
        return value[HEAD_INPUT] if value and HEAD_INPUT in value else None

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
        states = [] if self.states is None else self.states.all_arrays()
        return self.kv.arrays() + states
