"""The runner's row table: the runner side of the FutureMap (docs/architecture.md, section 5)
and what each request-pool row holds between steps. The scheduler addresses everything by row
id; row 0 is padding.

Where a row is, by state:
- `token_buf[row]`: the token the row sampled last. A row belongs to one request from
  admission to release, so a future input resolved here (resolve_futures) is always that
  request's last token; the row's next request overwrites it with its own first sample.
- `state[row]`: its live recurrent-state slot (hybrid models), from admission until release
  or until the row donates the slot to the prefix tree. The state itself stays in the row's
  caches; storage.py reads it from there when an op keeps it.
- `pages[row]`: its page table, the scheduler's (PAGES ops): where its full-attention layers'
  KV is in the one pool (kv_pages.py), its cached prefix's pages first. Prompt chunks and the
  decode batch read this very list, so a PAGES op that extends it reaches both. Kept after
  release: the next request of the row replaces it (its PAGES may ride in the batch that
  releases the row, and ops apply before releases).
- `prefilling[row]`: its own per-layer mlx-lm caches, while its prompt runs chunk by chunk.
- `waiting[row]`: the same caches once its prompt was sampled on its own (nothing decoded in
  that step), until the first step that decodes it joins them to the decode batch. A request
  that ends there (one output token, or a stop at the first) never pays the join's copies,
  and what an op keeps of it (its KV, its state) is read from its own caches.
- `head_input[row]` (hybrid models): the LM head's input where the row last sampled, kept
  with its state when an op snapshots or donates it (an exact repeat samples from it), with
  the greedy head's token for it where that ran.
  Lazy: (the step's head input, the row's index in it, the step's greedy tokens or None).
- `decode`: the decode batch (decode_batch.py): one batched cache per layer, a position per
  row, so a decode step is one forward of shape [positions, 1]. `decode_rows` are the rows
  that decode, in position order. A row that stopped decoding but is not released yet (it
  finished while a step was in flight, or is being retracted) is parked there: it keeps its
  position and pages until it is released.

How a row moves, in a step's order: a PAGES op (set_pages) -> admit -> its first chunk
(start_prompt) -> its last chunk (end_prompt, then join_decode: at once when its last token
runs in this step's decode forward; wait_to_decode when the prompt was sampled on its own,
joining in keep_decoding when it first decodes) ->
keep_decoding leaves it out: parked -> release (its position becomes a hole), which forgets it
everywhere except `pages`.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx

from actors.model_runner.decode_batch import DecodeBatch
from actors.model_runner.errors import StepError
from actors.model_runner.kv_pages import KvPages
from actors.model_runner.layers import Layers
from actors.model_runner.windows import window_of


class Rows:
    def __init__(self, max_rows: int, store: KvPages):
        self.token_buf = mx.zeros((max_rows + 1,), dtype=mx.int32)  # row 0 is padding
        self.state: dict[int, int] = {}  # row -> its live state slot
        self.pages: dict[int, list[int]] = {}  # row -> its page table
        self.prefilling: dict[int, list[Any]] = {}  # row -> per-layer caches, mid-prompt
        self.waiting: dict[int, list[Any]] = {}  # row -> its caches, prompt done, not joined
        self.head_input: dict[int, tuple[mx.array, int, mx.array | None]] = {}
        self.decode = DecodeBatch(store)

    # -- admission, release, ops ----------------------------------------------------------------

    def admit(self, row: int, state_slot: int) -> None:
        """The row starts a request; state_slot < 0: it keeps no recurrent state."""
        if state_slot >= 0:
            self.state[row] = state_slot
        self.head_input.pop(row, None)

    def release(self, rows: list[int]) -> None:
        """The scheduler freed these rows: drop their caches and their live state."""
        for row in rows:
            self.prefilling.pop(row, None)
            self.waiting.pop(row, None)
            self.state.pop(row, None)
            self.head_input.pop(row, None)
        self.decode.release(rows)

    def donate(self, row: int, slot: int) -> None:
        """The row gives its live state slot to the prefix tree, which keeps its state as it
        is now (storage.py): the slot is no longer the row's."""
        if self.state.get(row) != slot:
            raise StepError(f"row {row} donates state slot {slot}, but its live state "
                            f"is {self.state.get(row)}")
        del self.state[row]

    def set_pages(self, row: int, start: int, pages: list[int]) -> None:
        """The row's page table from index `start` on (in place: its readers hold the list)."""
        if start == 0:  # a new request's table: a new list (the last one's readers may hold theirs)
            self.pages[row] = list(pages)
            return
        table = self.pages.get(row, [])
        if start > len(table):
            raise StepError(f"row {row}: pages from index {start} of a table of {len(table)}")
        del table[start:]
        table += pages

    def holder(self, slot: int) -> int | None:
        """The row holding this state slot live, if one does."""
        return next((r for r, s in self.state.items() if s == slot), None)

    def live_states(self, row: int, layers: Layers) -> dict[int, list[Any]] | None:
        """The row's state now (layer -> its arrays: a recurrent layer's state, a sliding
        layer's window), where its caches hold it: mid prompt, or decoding. None before its
        first chunk, and once parked (the decode forward runs parked positions too, so their
        state there is not theirs any more)."""
        own = self._own_caches(row)
        if own is not None:
            got = {i: list(own[i].cache) for i in layers.linear}
            return got | {i: window_of(own[i]) for i in layers.windows}
        if row in self.decode.decoding:
            return self.decode.states_of(row, layers)
        return None

    def _own_caches(self, row: int) -> list[Any] | None:
        """The row's per-layer caches of its own (mid-prompt, or waiting to decode), if any."""
        own = self.prefilling.get(row)
        return self.waiting.get(row) if own is None else own

    # -- prompts --------------------------------------------------------------------------------

    def prompt_cache(self, row: int) -> list[Any] | None:
        return self.prefilling.get(row)

    def start_prompt(self, row: int, cache: list[Any]) -> None:
        self.prefilling[row] = cache

    def end_prompt(self, row: int) -> None:
        """The row's last chunk runs: its caches now go to the decode batch."""
        del self.prefilling[row]

    # -- the decode batch -----------------------------------------------------------------------

    @property
    def decode_rows(self) -> list[int]:
        return self.decode.rows

    def join_decode(self, row: int, cache: list[Any]) -> None:
        self.decode.join(row, cache, self.pages[row])

    def wait_to_decode(self, row: int, cache: list[Any]) -> None:
        """The row's prompt was sampled on its own: it joins the batch when it first decodes."""
        self.waiting[row] = cache

    def parking(self, rows: list[int]) -> list[int]:
        """The rows that decoded and will not in a step that decodes `rows`."""
        return sorted(self.decode.decoding - set(rows))

    def keep_decoding(self, rows: list[int]) -> None:
        """The rows this step decodes; the others that decoded are parked. Nothing is copied:
        the decode batch keeps every position until its row is released."""
        for row in rows:
            cache = self.waiting.pop(row, None)
            if cache is not None:
                self.decode.join(row, cache, self.pages[row])
        missing = set(rows) - self.decode.decoding
        if missing:
            raise StepError(f"rows {sorted(missing)} decode but were never prefilled")
        self.decode.keep(rows)

    # -- the FutureMap --------------------------------------------------------------------------

    def resolve_futures(self, joining: dict[int, int]) -> mx.array:
        """The decode forward's inputs [positions, 1]: each row's last sampled token, or for a
        row whose prompt ends in this step (`joining`) its last prompt token."""
        if joining:
            at = mx.array(list(joining))
            self.token_buf[at] = mx.array(list(joining.values()), dtype=mx.int32)
        return self.decode.inputs(self.token_buf)

    def keep_head_input(self, rows: list[int], x: mx.array,
                        greedy: mx.array | None = None) -> None:
        """x [len(rows), hidden]: the head's input of the rows that sampled, in order; greedy
        [len(rows)]: the greedy head's tokens for them, where it ran."""
        for i, row in enumerate(rows):
            self.head_input[row] = (x, i, greedy)

    def head_input_of(self, row: int) -> tuple[mx.array | None, mx.array | None]:
        """The head's input where the row last sampled ([hidden]) and the greedy head's token
        for it ([] int32), each None where not kept."""
        got = self.head_input.get(row)
        if got is None:
            return None, None
        x, i, greedy = got
        return x[i], None if greedy is None else greedy[i]

    def record(self, rows: list[int], tokens: mx.array) -> None:
        """The rows sampled these tokens (lazily): their next future inputs."""
        self.token_buf[mx.array(rows)] = tokens
