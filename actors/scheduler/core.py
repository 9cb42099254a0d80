"""The scheduler's pure core: queue, admission, batch composition, stop checks, finish reasons.

No sockets, no arrays, no clock. The shell feeds it requests, aborts and step results, and ships
what it returns. API: add, abort, schedule() -> ForwardBatch | None, on_result(result), take().

A decode row never carries its input token: it is a future ("whatever this row sampled last"),
resolved by the runner from its token buffer, so step N+1 can be built before step N's tokens
are known (overlap). Nothing a built step references (row, KV slots) is freed before that step
returns: a request counts the steps in flight that carry it, and is released at zero.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import count
from typing import Callable

from protocol import messages as m
from protocol.codec import pack_ids
from actors.scheduler.memory import Memory
from actors.scheduler.pools import RowPool

QUEUED, RUNNING, DONE = "queued", "running", "done"


def _needs_history(p: m.SamplingParams) -> bool:
    """Penalties read the tokens so far: only then do they travel to the runner."""
    return (p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0
            or p.presence_penalty != 0.0)


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: m.SamplingParams
    order: int  # arrival order: FIFO admission, newest retracted first
    phase: str = QUEUED
    row: int = 0
    slots: list[int] = field(default_factory=list)  # KV slot per position, [:tree_len] cached
    tree_len: int = 0
    lock: object = None  # the radix node this request holds locked
    state: int = -1  # live recurrent-state slot (hybrid models)
    cached: int = 0  # prompt tokens reused from the prefix cache at admission
    group: str = ""  # n choices of one prompt: prefilled once, shared through the cache
    output: list[int] = field(default_factory=list)
    fill: list[int] = field(default_factory=list)  # what admission prefills: prompt (+ output)
    filled: int = 0  # tokens of `fill` that built steps prefill
    kv_len: int = 0  # tokens whose KV built steps write
    sampled: int = 0  # output tokens that received or built steps produce
    inflight: int = 0  # built steps not yet returned that carry this request
    aborted: bool = False
    announced: bool = False  # the detokenizer has been told its stop strings
    stop_str: str = ""
    retracting: bool = False
    retractions: int = 0
    finish_reason: str = ""

    @property
    def prefilling(self) -> bool:
        return self.filled < len(self.fill)


@dataclass
class Outputs:
    """What the core produced since the last take(): new tokens per rid, terminal records, and
    the requests sent back to the queue for lack of memory (for the logs)."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[m.Finish] = field(default_factory=list)
    retracted: list[str] = field(default_factory=list)
    # Per token in `tokens` when asked: (logprob, top ids, top logprobs).
    logprobs: dict[str, list[tuple[float, list[int], list[float]]]] = field(default_factory=dict)
    stops: dict[str, list[str]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished)

    def to_batch(self, running: int = 0, queued: int = 0) -> m.TokenBatch:
        rids = list(self.tokens)
        flat = [t for rid in rids for t in self.tokens[rid]]
        lps: list[float] = []
        top_ids: list[list[int]] = []
        top_lps: list[list[float]] = []
        if self.logprobs:
            for rid in rids:
                got = self.logprobs.get(rid) or [(0.0, [], [])] * len(self.tokens[rid])
                for lp, ids, vals in got:
                    lps.append(lp); top_ids.append(ids); top_lps.append(vals)
        return m.TokenBatch(rids=rids, counts=[len(self.tokens[r]) for r in rids],
                            token_ids=pack_ids(flat), finished=self.finished, logprobs=lps,
                            top_ids=top_ids, top_logprobs=top_lps, stops=self.stops,
                            running=running, queued=queued)

    def merge(self, other: "Outputs") -> None:
        for rid, toks in other.tokens.items():
            self.tokens.setdefault(rid, []).extend(toks)
        for rid, lps in other.logprobs.items():
            self.logprobs.setdefault(rid, []).extend(lps)
        self.finished.extend(other.finished)
        self.retracted.extend(other.retracted)
        self.stops.update(other.stops)


class Scheduler:
    def __init__(self, *, max_running: int, context_length: int, eos_ids: list[int],
                 chunked_prefill_size: int = 512, kv_slots: int = 1 << 20,
                 max_queued: int = 1 << 16, output_reserve: int = 64, state_slots: int = 0,
                 prefix_cache: bool = False, snapshot_interval: int = 0,
                 decode: Callable[[list[int]], str] | None = None, share_groups: bool = True):
        self.rows = RowPool(max_running)
        # share_groups False (a model whose layers the tree cannot restore, layers.py): the
        # choices of a group prefill on their own, and nothing goes through the tree.
        self.memory = Memory(kv_slots, state_slots, prefix_cache, share_groups)
        self.slots = self.memory.slots
        self.chunk = chunked_prefill_size
        # Hybrid models resume a prefix only where a state snapshot was taken, and snapshots
        # are taken at chunk boundaries: cut prefill chunks at multiples of this interval.
        self.snapshot_interval = snapshot_interval if state_slots and prefix_cache else 0
        self.context_length = context_length
        self.decode = decode  # for stop strings: decodes the tail of an output
        self.eos_ids = frozenset(eos_ids)
        self.max_queued = max_queued
        self.output_reserve = output_reserve
        self.queue: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # every request not yet released
        self.running: list[Request] = []  # holding a row, not finished
        self.in_flight: deque[tuple[m.ForwardBatch, list[Request]]] = deque()
        self.step = 0
        self.retractions = 0  # total, for the logs and tests
        self._order = count()
        self._released_rows: list[int] = []
        self._out = Outputs()

    # -- inputs ------------------------------------------------------------------------------

    def add(self, rid: str, prompt: list[int], params: m.SamplingParams,
            group: str = "") -> Outputs:
        if rid in self.requests:
            return self._reject(rid, len(prompt), f"duplicate request id {rid!r}")
        if len(prompt) >= self.context_length:
            return self._reject(rid, len(prompt), f"prompt has {len(prompt)} tokens; the "
                                f"model's context is {self.context_length}")
        need = len(prompt) + self._reserve(params.max_new_tokens)
        if need > self.slots.capacity:
            return self._reject(rid, len(prompt), f"prompt of {len(prompt)} tokens plus an "
                                f"output reserve needs {need} KV slots; the server has "
                                f"{self.slots.capacity}")
        if len(self.queue) >= self.max_queued:
            return self._reject(rid, len(prompt), f"queue full ({self.max_queued} requests "
                                "waiting); retry later", code=503)
        req = Request(rid, prompt, params, next(self._order), fill=list(prompt), group=group)
        self.requests[rid] = req
        self.queue.append(req)
        return self.take()

    def abort(self, rid: str) -> Outputs:
        req = self.requests.get(rid)
        if req is None or req.phase == DONE:
            return self.take()  # unknown or already ending: its one reply is on its way
        if req.phase == QUEUED:
            self.queue.remove(req)
            self._finish(req, "abort")
            self._release(req)
        else:
            # A step in flight may touch its row and slots: only mark it. The next result
            # that carries it ends it; if none is in flight, the next schedule() does.
            req.aborted = True
        return self.take()

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> m.ForwardBatch | None:
        for req in [r for r in self.running if r.inflight == 0 and (r.aborted or r.retracting)]:
            self._settle(req)

        rows, lens, starts, future, sample, ids = [], [], [], [], [], []
        carried: list[Request] = []

        def add_row(req: Request, n: int, start: int, fut: bool, smp: bool) -> None:
            rows.append(req.row); lens.append(n); starts.append(start)
            future.append(fut); sample.append(smp)
            carried.append(req)

        for req in self._decodable():
            req.slots += self.slots.alloc(1)
            add_row(req, 1, req.kv_len, True, True)
            req.kv_len += 1
            req.sampled += 1

        admit_rows, admit_params, admit_states = [], [], []
        admit_generated: list[int] = []
        admit_tokens: list[bytes] = []
        budget = self.chunk
        for req in [r for r in self.running if r.prefilling and self._active(r)]:
            # The chunks so far become a cached prefix others can share (hybrid: with a
            # snapshot of the state after them), in the batch that runs the next chunk.
            self.memory.cache_prefix(req, req.row, req.filled)
            budget -= self._prefill_chunk(req, budget, add_row, ids)
        while budget > 0 and self.queue and self.rows.available:
            req = self.queue[0]
            if self._sibling_prefilling(req):
                break  # its prompt is being computed for a sibling: wait, then reuse it
            row = self.rows.alloc()
            if not self.memory.admit(req, row, self._reserve(self._left(req))):
                self.rows.free(row)
                break  # FIFO: the head waits for memory, nothing overtakes it
            self.queue.popleft()
            req.row, req.phase = row, RUNNING
            self.running.append(req)
            admit_rows.append(row); admit_params.append(req.params)
            admit_states.append(req.state)
            admit_generated.append(len(req.output))
            admit_tokens.append(pack_ids(req.fill) if _needs_history(req.params) else b"")
            budget -= self._prefill_chunk(req, budget, add_row, ids)

        ops = self.memory.take_ops()
        if not rows and not self._released_rows and not ops:
            return None
        self.step += 1
        for req in carried:
            req.inflight += 1
        batch = m.ForwardBatch(step=self.step, rows=rows, input_lens=lens, start_pos=starts,
                               future=future, sample=sample, input_ids=pack_ids(ids),
                               admit_rows=admit_rows, admit_params=admit_params,
                               release_rows=self._released_rows, ops=ops,
                               admit_states=admit_states if self.memory.states else [],
                               admit_generated=admit_generated, admit_tokens=admit_tokens)
        self._released_rows = []
        self.in_flight.append((batch, carried))
        return batch

    def on_result(self, result: m.StepResult) -> Outputs:
        batch, carried = self.in_flight.popleft()
        if result.step != batch.step:
            raise AssertionError(f"result for step {result.step}, expected {batch.step}")
        k = -1  # index of this row's sample in the result
        for req, samples in zip(carried, batch.sample):
            req.inflight -= 1
            k += samples
            token = result.tokens[k] if samples and not result.error else None
            if req.phase == DONE:
                pass  # finished at an earlier step while already in this one: drop its token
            elif result.error:
                self._finish(req, "error", f"model runner failed: {result.error}")
            elif req.aborted:
                self._finish(req, "abort")
            elif token is not None:
                req.output.append(token)
                self._out.tokens.setdefault(req.rid, []).append(token)
                if result.logprobs:
                    self._out.logprobs.setdefault(req.rid, []).append(
                        (result.logprobs[k], result.top_ids[k], result.top_logprobs[k]))
                if not req.announced:
                    req.announced = True
                    if req.params.stop:
                        self._out.stops[req.rid] = req.params.stop
                reason = self._stop_reason(req, token)
                if reason:
                    self._finish(req, reason)
            if req.inflight == 0:
                self._settle(req)
        return self.take()

    # -- admission and memory ----------------------------------------------------------------

    def _prefill_chunk(self, req: Request, budget: int, add_row, ids: list[int]) -> int:
        n = min(len(req.fill) - req.filled, budget)
        if req.group and self.memory.tree is not None and n == len(req.fill) - req.filled > 1:
            n -= 1  # end a chunk at the prompt's last token: siblings resume from there
        if self.snapshot_interval:
            n = min(n, self.snapshot_interval - req.filled % self.snapshot_interval)
        if n <= 0:
            return 0
        last = req.filled + n == len(req.fill)
        add_row(req, n, req.filled, False, last)
        ids.extend(req.fill[req.filled:req.filled + n])
        req.filled += n
        req.kv_len += n
        if last:
            req.sampled += 1
        return n

    def _sibling_prefilling(self, req: Request) -> bool:
        """With the prefix cache on, a request of a group waits while a sibling is still
        computing the shared prompt (cached once its chunk before the last token is done)."""
        if not req.group or self.memory.tree is None:
            return False
        return any(r.group == req.group and self._active(r) and r.tree_len < len(r.fill) - 1
                   for r in self.running)

    def _decodable(self) -> list[Request]:
        """Running requests that get a decode row in the next step, after retracting the ones
        with least progress until every remaining one has a free slot for its next token."""
        want = [r for r in self.running if self._active(r) and not r.prefilling
                and r.sampled > 0 and self._wants_more(r)]
        while not self.memory.make_room(len(want)):
            victim = min((r for r in self.running if self._active(r)),
                         key=lambda r: (len(r.output), -r.order))
            if victim in want:
                want.remove(victim)
            others = any(r is not victim and (r.slots or r.lock is not None)
                         for r in self.requests.values())
            if not others:
                # Alone and still out of memory: the server's KV capacity is this request's
                # length limit. Retracting it could never help.
                self._finish(victim, "length")
            else:
                victim.retracting = True
            if victim.inflight == 0:
                self._settle(victim)
        return want

    def _active(self, req: Request) -> bool:
        return req.phase == RUNNING and not req.aborted and not req.retracting

    def _left(self, req: Request) -> int:
        return req.params.max_new_tokens - len(req.output)

    def _reserve(self, left: int) -> int:
        return max(0, min(left, self.output_reserve))

    def _wants_more(self, req: Request) -> bool:
        return req.sampled < req.params.max_new_tokens and req.kv_len < self.context_length

    def _stop_reason(self, req: Request, token: int) -> str:
        p = req.params
        if len(req.output) > p.min_new_tokens:
            if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
                return "stop"
            if p.stop and self.decode is not None:
                # A stop string counts where it ends in this token's text (one that completed
                # earlier, before min_new_tokens, does not); a character can take up to 4
                # tokens in byte-level BPE, hence the window.
                window = 4 * max(map(len, p.stop)) + 2
                tail = self.decode(req.output[-window:])
                if any(stop in tail for stop in p.stop):  # the second decode only on a hit
                    new_from = len(self.decode(req.output[-window:-1]))
                    for stop in p.stop:
                        if tail.find(stop, max(0, new_from - len(stop) + 1)) >= 0:
                            req.stop_str = stop
                            return "stop"
        if len(req.output) >= p.max_new_tokens:
            return "length"
        if len(req.prompt) + len(req.output) >= self.context_length:
            return "length"
        return ""

    # -- endings -----------------------------------------------------------------------------

    def _settle(self, req: Request) -> None:
        """A request no step in flight carries any more: end what was decided for it."""
        if req.phase == RUNNING and req.aborted:
            self._finish(req, "abort")
        if req.phase == DONE:
            self._release(req)
        elif req.retracting:
            self._requeue(req)

    def _requeue(self, req: Request) -> None:
        """Give back its memory and recompute it later from prompt + output so far."""
        self._free_memory(req)
        self.running.remove(req)
        req.phase, req.retracting = QUEUED, False
        req.fill = req.prompt + req.output
        req.filled = req.kv_len = 0
        req.sampled = len(req.output)
        req.retractions += 1
        self.retractions += 1
        self.queue.appendleft(req)
        self._out.retracted.append(req.rid)

    def _finish(self, req: Request, reason: str, message: str = "") -> None:
        req.phase = DONE
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._out.finished.append(m.Finish(
            rid=req.rid, reason=reason, prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output), cached_tokens=req.cached, message=message,
            stop_str=req.stop_str))

    def _release(self, req: Request) -> None:
        self._free_memory(req)
        self.requests.pop(req.rid, None)

    def _free_memory(self, req: Request) -> None:
        # What it computed stays cached (prefix cache on) unless the runner failed under it.
        self.memory.release(req, req.row, keep=req.finish_reason != "error")
        if req.row:
            self.rows.free(req.row)
            self._released_rows.append(req.row)
            req.row = 0

    def _reject(self, rid: str, prompt_len: int, message: str, code: int = 400) -> Outputs:
        self._out.finished.append(m.Finish(rid=rid, reason="error", prompt_tokens=prompt_len,
                                           completion_tokens=0, message=message, code=code))
        return self.take()

    def take(self) -> Outputs:
        out, self._out = self._out, Outputs()
        return out

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running and not self.in_flight

    def leaks(self) -> dict[str, list]:
        """When idle, every row is free, every KV and state slot is free or held by the prefix
        cache, no lock is held and no request remains: anything else leaked."""
        return {"rows": self.rows.leaked(), **self.memory.leaks(),
                "requests": sorted(self.requests)}
