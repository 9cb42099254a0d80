"""One request as the scheduler sees it, from arrival to release: a small state machine.

    QUEUED --admit--> RUNNING --stop/length/abort/error--> DONE --no step in flight--> released
       ^                 |
       +---retract-------+   (out of memory: give back row and pages, recompute prompt + output)

A request leaves the scheduler (`Scheduler.requests`) only when no built step carries it any
more (`inflight == 0`, future_map.py): until then its row and KV pages may still be written.
`aborted` and `retracting` mark a RUNNING request whose ending waits for its steps in flight.

Counters, and what always holds between them (checked by tests/core/test_scheduler_properties.py):
- `fill`: what admission prefills (the prompt; prompt + output after a retraction).
- `tree_len <= filled <= len(fill)`: the first `tree_len` positions are in the radix tree (the
  cached prefix at admission, then each chunk as it is cached), `filled` positions are in built
  prefill steps. `prefilling` while `filled < len(fill)`.
- `kv_len`: positions whose KV built steps write: `filled`, plus one per decode row built.
- `pages`: the page table: position p's KV is at slot `pages[p // KV_PAGE] * KV_PAGE +
  p % KV_PAGE` (`slots()`). It covers the whole fill from admission and grows a page at a time
  as decode rows cross into the next: `len(pages) == ceil(max(len(fill), kv_len) / KV_PAGE)`.
  A page of its cached prefix that the tree holds whole is shared, read in place; the others
  are its own (the rest of the prefix copied into them at admission).
- `held`: the KV slots it frees at release: every slot of the pages it allocated, less those
  the tree took over (positions it cached first). A slot is held by one request or the tree.
- `sampled`: output tokens received plus those built steps will sample; `len(output) <= sampled`,
  the difference is what the steps in flight will bring. A row can decode (its input is a
  future) once `sampled > 0`.
- `inflight`: built steps not yet returned that carry the request (owned by FutureMap).
- `cached`: prompt tokens reused at the first admission (reported; retractions do not change it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from actors.scheduler.pools import pages_for
from protocol import messages as m
from protocol.messages import KV_PAGE


class Phase(Enum):
    QUEUED = "queued"
    RUNNING = "running"  # holds a row
    DONE = "done"  # its Finish is out; released once no step in flight carries it


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: m.SamplingParams
    order: int  # arrival order: FIFO admission, newest retracted first
    phase: Phase = Phase.QUEUED
    row: int = 0
    pages: list[int] = field(default_factory=list)  # KV page table
    held: set[int] = field(default_factory=set)  # KV slots it frees at release
    tree_len: int = 0
    lock: object = None  # the radix node this request holds locked
    state: int = -1  # live recurrent-state slot (hybrid models)
    cached: int = 0
    group: str = ""  # n choices of one prompt: prefilled once, shared through the cache
    output: list[int] = field(default_factory=list)
    fill: list[int] = field(default_factory=list)
    filled: int = 0
    # Positions where a prefill chunk must end, ascending, set at admission: the radix tree
    # takes the prefix (a hybrid model's state snapshotted) where a chunk ends (memory.py).
    chunk_ends: list[int] = field(default_factory=list)
    kv_len: int = 0
    sampled: int = 0
    inflight: int = 0
    aborted: bool = False
    announced: bool = False  # the detokenizer has been told its stop strings
    stop_str: str = ""
    retracting: bool = False
    retractions: int = 0
    finish_reason: str = ""
    # Prompt logprobs (params.prompt_logprobs_from >= 0): the scored chunks' results as they
    # land, sent whole with the first token (`scored` then).
    scores: list[m.PromptScores] = field(default_factory=list)
    scored: bool = False
    overtaken: int = 0  # queued requests admitted before it while it led the queue (core.py)

    def slots(self, start: int, end: int) -> list[int]:
        """The KV slots of positions [start, end), through the page table."""
        return [self.pages[p // KV_PAGE] * KV_PAGE + p % KV_PAGE for p in range(start, end)]

    def pages_short(self, positions: int) -> int:
        """Pages the table lacks to hold this many positions."""
        return max(0, pages_for(positions) - len(self.pages))

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.fill)

    @property
    def active(self) -> bool:
        """Running and not on its way out: gets rows in the next step."""
        return self.phase is Phase.RUNNING and not self.aborted and not self.retracting

    @property
    def scoring(self) -> bool:
        """Its prompt's positions are to be scored: prefix hits stop short of them, and its
        prompt chunks carry the positions to score (batch.py)."""
        return self.params.prompt_logprobs_from >= 0 and not self.scored

    @property
    def left(self) -> int:
        """Output tokens it may still produce."""
        return self.params.max_new_tokens - len(self.output)

    @property
    def needs_history(self) -> bool:
        """Penalties read the tokens so far, and a resumed constrained row's matcher its output
        so far: only then do they travel to the runner."""
        p = self.params
        return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
                or p.presence_penalty != 0.0 or bool(p.constraint_kind and self.output))
