"""The scheduler's queue of deferred memory ops (docs/architecture.md, section 6; the
vocabulary is protocol.messages.OpKind, applied by the runner in
actors/model_runner/storage.py).

Memory decisions are made here, on ids only; the runner carries them out at the start of the
forward they ride with, in the order they were queued, so no op races a step. Everything queued
since the last step goes into the next ForwardBatch.
"""

from __future__ import annotations

from protocol import messages as m
from protocol.codec import pack_ids

Kind = m.OpKind


class OpQueue:
    def __init__(self):
        self._ops: list[m.Op] = []

    def __len__(self) -> int:
        return len(self._ops)

    def clear(self, state: int) -> None:
        """A request with no usable prefix starts its recurrent state from zeros."""
        self._ops.append(m.Op(kind=Kind.CLEAR, dst=state))

    def copy(self, src: int, dst: int) -> None:
        """A prefix hit starts from the node's snapshot; the node keeps it."""
        self._ops.append(m.Op(kind=Kind.COPY, src=src, dst=dst))

    def snapshot(self, live: int, node_slot: int, head_input: bool = False) -> None:
        """At a chunk boundary, the live state is kept for the radix node just inserted (with
        the LM head's input at the last position, where the row sampled there)."""
        self._ops.append(m.Op(kind=Kind.SNAPSHOT, src=live, dst=node_slot, head_input=head_input))

    def donate(self, row: int, live: int, head_input: bool = False) -> None:
        """A request ended exactly at a cached prefix: its live slot becomes the node's, no copy."""
        self._ops.append(m.Op(kind=Kind.DONATE, src=live, dst=row, head_input=head_input))

    def pages(self, row: int, start: int, pages: list[int]) -> None:
        """The row's page table from index `start` on is `pages` (start 0: the whole table)."""
        self._ops.append(m.Op(kind=Kind.PAGES, dst=row, start=start, slots=pack_ids(pages)))

    def kv_copy(self, src: list[int], dst: list[int]) -> None:
        """KV of slots `src` into slots `dst` of the one pool, pairwise."""
        if len(src) != len(dst):
            raise ValueError(f"a KV copy of {len(src)} slots into {len(dst)}")
        self._ops.append(m.Op(kind=Kind.KV_COPY, slots=pack_ids(list(src) + list(dst))))

    def take(self) -> list[m.Op]:
        ops, self._ops = self._ops, []
        return ops
