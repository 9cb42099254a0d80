"""The scheduler's pure core: queue, admission, batch composition, stop checks, finish reasons.

No sockets, no arrays, no clock. The shell feeds it requests, aborts and step results, and ships
what it returns. API: add, abort, schedule() -> ForwardBatch | None, on_result(result).

A decode row never carries its input token: it is a future ("whatever this row sampled last"),
resolved by the runner from its token buffer, so a step can be built before the previous
step's tokens are known (overlap) without the scheduler ever touching an array.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from protocol import messages as m
from protocol.codec import pack_ids
from actors.scheduler.pools import RowPool

QUEUED, RUNNING, DONE = "queued", "running", "done"


@dataclass(eq=False)
class Request:
    rid: str
    prompt: list[int]
    params: m.SamplingParams
    state: str = QUEUED
    row: int = 0
    output: list[int] = field(default_factory=list)
    kv_len: int = 0  # tokens whose KV is written by steps already built
    sampled: int = 0  # tokens that steps already built will sample
    inflight: int = 0  # steps built and not yet returned that carry this request
    aborted: bool = False
    finish_reason: str = ""


@dataclass
class Outputs:
    """What one call produced for the detokenizer: new tokens per rid and terminal records."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    finished: list[m.Finish] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished)

    def to_batch(self) -> m.TokenBatch:
        rids = list(self.tokens)
        flat = [t for rid in rids for t in self.tokens[rid]]
        return m.TokenBatch(rids=rids, counts=[len(self.tokens[r]) for r in rids],
                            token_ids=pack_ids(flat), finished=self.finished)


class Scheduler:
    def __init__(self, *, max_running: int, max_prefill_tokens: int, context_length: int,
                 eos_ids: list[int]):
        self.rows = RowPool(max_running)
        self.max_prefill_tokens = max_prefill_tokens
        self.context_length = context_length
        self.eos_ids = frozenset(eos_ids)
        self.queue: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # every request not yet released
        self.running: list[Request] = []  # admitted, holding a row, not finished
        self.in_flight: deque[tuple[m.ForwardBatch, list[Request]]] = deque()
        self.step = 0
        self._out = Outputs()

    # -- inputs ------------------------------------------------------------------------------

    def add(self, rid: str, prompt: list[int], params: m.SamplingParams) -> Outputs:
        if rid in self.requests:
            return self._reject(rid, len(prompt), f"duplicate request id {rid!r}")
        if len(prompt) >= self.context_length:
            return self._reject(rid, len(prompt), f"prompt has {len(prompt)} tokens; the "
                                f"model's context is {self.context_length}")
        req = Request(rid, prompt, params)
        self.requests[rid] = req
        self.queue.append(req)
        return self.take()

    def abort(self, rid: str) -> Outputs:
        req = self.requests.get(rid)
        if req is None or req.state == DONE:
            return self.take()  # unknown or already ending: its one reply is on its way
        if req.state == QUEUED:
            self.queue.remove(req)
            self._finish(req, "abort")
            self._release(req)
        else:
            # Running: a step in flight may touch its row, so only mark it; the next result
            # (or the next schedule, if nothing is in flight) finishes it.
            req.aborted = True
        return self.take()

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> m.ForwardBatch | None:
        for req in [r for r in self.running if r.aborted and r.inflight == 0]:
            self._finish(req, "abort")
            self._release(req)

        rows, lens, starts, future, sample, ids = [], [], [], [], [], []
        carried: list[Request] = []
        # Decode every running request that has a token coming and room for another.
        for req in self.running:
            if req.aborted or req.sampled == 0 or not self._wants_more(req):
                continue
            rows.append(req.row); lens.append(1); starts.append(req.kv_len)
            future.append(True); sample.append(True)
            req.kv_len += 1
            req.sampled += 1
            carried.append(req)

        admit_rows, admit_params = [], []
        budget = self.max_prefill_tokens
        while self.queue and self.rows.available:
            req = self.queue[0]
            # A prompt longer than the budget still runs, alone, so nothing starves.
            if len(req.prompt) > budget and admit_rows:
                break
            self.queue.popleft()
            req.row = self.rows.alloc()
            req.state = RUNNING
            self.running.append(req)
            budget -= len(req.prompt)
            rows.append(req.row); lens.append(len(req.prompt)); starts.append(0)
            future.append(False); sample.append(True)
            ids.extend(req.prompt)
            req.kv_len = len(req.prompt)
            req.sampled = 1
            admit_rows.append(req.row); admit_params.append(req.params)
            carried.append(req)

        if not rows:
            return None
        self.step += 1
        for req in carried:
            req.inflight += 1
        batch = m.ForwardBatch(step=self.step, rows=rows, input_lens=lens, start_pos=starts,
                               future=future, sample=sample, input_ids=pack_ids(ids),
                               admit_rows=admit_rows, admit_params=admit_params)
        self.in_flight.append((batch, carried))
        return batch

    def on_result(self, result: m.StepResult) -> Outputs:
        batch, carried = self.in_flight.popleft()
        if result.step != batch.step:
            raise AssertionError(f"result for step {result.step}, expected {batch.step}")
        tokens = iter(result.tokens)
        for req, samples in zip(carried, batch.sample):
            req.inflight -= 1
            token = next(tokens) if samples and not result.error else None
            if req.state == DONE:
                pass  # finished at an earlier step while already in this one: drop its token
            elif result.error:
                self._finish(req, "error", f"model runner failed: {result.error}")
            elif req.aborted:
                self._finish(req, "abort")
            elif token is not None:
                req.output.append(token)
                self._out.tokens.setdefault(req.rid, []).append(token)
                reason = self._stop_reason(req, token)
                if reason:
                    self._finish(req, reason)
            self._release_if_idle(req)
        return self.take()

    # -- helpers -----------------------------------------------------------------------------

    def _wants_more(self, req: Request) -> bool:
        return req.sampled < req.params.max_new_tokens and req.kv_len < self.context_length

    def _stop_reason(self, req: Request, token: int) -> str:
        p = req.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return "stop"
        if len(req.output) >= p.max_new_tokens:
            return "length"
        if len(req.prompt) + len(req.output) >= self.context_length:
            return "length"
        return ""

    def _finish(self, req: Request, reason: str, message: str = "") -> None:
        req.state = DONE
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._out.finished.append(m.Finish(
            rid=req.rid, reason=reason, prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output), message=message))

    def _release_if_idle(self, req: Request) -> None:
        if req.state == DONE and req.inflight == 0:
            self._release(req)

    def _release(self, req: Request) -> None:
        if req.row:
            self.rows.free(req.row)
            req.row = 0
        self.requests.pop(req.rid, None)

    def _reject(self, rid: str, prompt_len: int, message: str) -> Outputs:
        self._out.finished.append(m.Finish(rid=rid, reason="error", prompt_tokens=prompt_len,
                                           completion_tokens=0, message=message, code=400))
        return self.take()

    def take(self) -> Outputs:
        out, self._out = self._out, Outputs()
        return out

    @property
    def idle(self) -> bool:
        return not self.queue and not self.running and not self.in_flight

    def leaks(self) -> dict[str, list]:
        """When idle, every row is free and no request is held: anything else is a leak."""
        return {"rows": self.rows.leaked(), "requests": sorted(self.requests)}
