"""The scheduler's pure core: queue, admission, batch composition, stop checks, finish reasons.

No sockets, no arrays, no clock. The shell feeds it requests, aborts and step results, and ships
what it returns. API: add, abort, schedule() -> ForwardBatch | None, on_result(result), take().

schedule() is policy only: which running requests decode, how much of which prompt runs within
the chunk budget, who is admitted (FIFO, while memory lasts) and who is retracted. The pieces it
decides with have their own files: request.py (a request's states and counters), future_map.py
(decode inputs are futures; steps in flight pin what they carry), batch.py (the ForwardBatch's
columns), retraction.py (who gives memory back when decode runs out), memory.py (KV pages,
state slots, the prefix tree and the ops for the runner).
"""

from __future__ import annotations

from collections import deque
from itertools import count, islice
from typing import Callable

from protocol import messages as m
from actors.scheduler.batch import BatchBuilder
from actors.scheduler.future_map import FutureMap
from actors.scheduler.memory import Memory
from actors.scheduler.outputs import Outputs
from actors.scheduler.pools import RowPool
from actors.scheduler.request import Phase, Request
from actors.scheduler.retraction import pick_victim, recompute_later, would_help


# _admit_cached: how deep into the queue it looks for nearly cached prompts, and how many it
# may admit before the queue's head.
SCAN_QUEUED = 64
MAX_OVERTAKES = 32


class Scheduler:
    def __init__(self, *, max_running: int, context_length: int, eos_ids: list[int],
                 chunked_prefill_size: int = 512, kv_slots: int = 1 << 20,
                 max_queued: int = 1 << 16, output_reserve: int = 64, state_slots: int = 0,
                 prefix_cache: bool = False, snapshot_interval: int = 0,
                 decode: Callable[[list[int]], str] | None = None, share_groups: bool = True,
                 head_input: bool = False, prefill_first: bool = False,
                 cached_first: bool = True):
        self.rows = RowPool(max_running)
        # share_groups False (a model whose layers the tree cannot restore, prefix_plan.py): the
        # choices of a group prefill on their own, and nothing goes through the tree.
        self.memory = Memory(kv_slots, state_slots, prefix_cache, share_groups, snapshot_interval,
                             head_input)
        self.kv = self.memory.kv
        self.chunk = chunked_prefill_size
        self.context_length = context_length
        self.decode = decode  # for stop strings: decodes the tail of an output
        self.eos_ids = frozenset(eos_ids)
        self.max_queued = max_queued
        self.output_reserve = output_reserve
        self.prefill_first = prefill_first
        self.cached_first = cached_first
        self.queue: deque[Request] = deque()
        self.requests: dict[str, Request] = {}  # every request not yet released
        self.running: list[Request] = []  # holding a row, not finished
        self.futures = FutureMap()
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
        if need > self.kv.capacity:
            return self._reject(rid, len(prompt), f"prompt of {len(prompt)} tokens plus an "
                                f"output reserve needs {need} KV slots; the server has "
                                f"{self.kv.capacity}")
        if len(self.queue) >= self.max_queued:
            return self._reject(rid, len(prompt), f"queue full ({self.max_queued} requests "
                                "waiting); retry later", code=503)
        req = Request(rid, prompt, params, next(self._order), fill=list(prompt), group=group)
        self.requests[rid] = req
        self.queue.append(req)
        return self.take()

    def abort(self, rid: str) -> Outputs:
        req = self.requests.get(rid)
        if req is None or req.phase is Phase.DONE:
            return self.take()  # unknown or already ending: its one reply is on its way
        if req.phase is Phase.QUEUED:
            self.queue.remove(req)
            self._finish(req, "abort")
            self._release(req)
        else:
            # A step in flight may touch its row and pages: only mark it. The next result
            # that carries it ends it; if none is in flight, the next schedule() does.
            req.aborted = True
        return self.take()

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> m.ForwardBatch | None:
        for req in [r for r in self.running if r.inflight == 0 and (r.aborted or r.retracting)]:
            self._settle(req)
        step = BatchBuilder()
        hold = self._hold_decode()
        if not hold:
            self._decode_rows(step)
        prefilling = [r for r in self.running if r.prefilling and r.active]
        budget = self.chunk - self._admit_cached(step)
        for req in prefilling:
            # The chunks so far become a cached prefix others can share (hybrid: with a
            # snapshot of the state after them), in the batch that runs the next chunk.
            self.memory.cache_prefix(req, req.row, req.filled)
            budget -= self._prefill_chunk(req, budget, step)
        while budget > 0 and self.queue and self.rows.available:
            req = self._admit_head()
            if req is None:
                break
            step.admit(req)
            budget -= self._prefill_chunk(req, budget, step)
        if hold and not step:  # the queue's head could not be admitted after all: decode
            hold = False
            self._decode_rows(step)

        ops = self.memory.ops.take()
        if not step and not self._released_rows and not ops:
            return None
        self.step += 1
        batch = step.build(self.step, ops, self._released_rows,
                           states=self.memory.states is not None, hold_decode=hold)
        self._released_rows = []
        self.futures.launch(batch, step.carried)
        return batch

    def on_result(self, result: m.StepResult) -> Outputs:
        batch = self.futures.oldest()
        landed = self.futures.land(result)
        if result.scores and not result.error:
            by_row = {req.row: req for req, _ in landed}
            for row, scores in zip(batch.score_rows, result.scores):
                req = by_row.get(row)
                if req is not None and req.scoring:
                    req.scores.append(scores)
        for req, k in landed:
            if req.phase is Phase.DONE:
                pass  # finished at an earlier step while already in this one: drop its token
            elif result.error:
                self._finish(req, "error", f"model runner failed: {result.error}")
            elif req.aborted:
                self._finish(req, "abort")
            elif k is not None:
                self._take_token(req, result, k)
            if req.inflight == 0:
                self._settle(req)
        if result.error:
            self._runner_reset()
        return self.take()

    def _runner_reset(self) -> None:
        """After a failed step the runner keeps nothing (actors/model_runner/actor.py, reset):
        the failed steps' requests end with the error (on_result), the tree forgets what it
        cached, and every other running request is recomputed from its prompt and output so
        far, as a retracted one is: its tokens stay those it would have had."""
        self.memory.forget()
        for req in list(self.running):
            if req.inflight:  # in the step built on the failed one, which fails too
                continue
            # Nothing it computed is cached: its KV went with the runner's memory.
            if req.aborted:
                self._finish(req, "abort")
                self._release(req, keep=False)
            else:
                self._requeue(req, keep=False)

    def _take_token(self, req: Request, result: m.StepResult, k: int) -> None:
        token = result.tokens[k]
        req.output.append(token)
        self._out.tokens.setdefault(req.rid, []).append(token)
        if result.logprobs:
            self._out.logprobs.setdefault(req.rid, []).append(
                (result.logprobs[k], result.top_ids[k], result.top_logprobs[k]))
        if not req.announced:
            req.announced = True
            if req.params.stop:
                self._out.stops[req.rid] = req.params.stop
        if req.scoring:
            self._out.prompt_scores[req.rid] = joined(req.params.prompt_logprobs_from,
                                                     req.scores)
            req.scored = True
        reason = self._stop_reason(req, token)
        if reason:
            self._finish(req, reason)

    # -- admission and memory ----------------------------------------------------------------

    def _admit_head(self) -> Request | None:
        """Give the queue's head a row and its memory; None (nothing taken) when it must wait."""
        req = self.queue[0]
        if self._sibling_prefilling(req):
            return None  # its prompt is being computed for a sibling: wait, then reuse it
        # FIFO: the head waits for memory, nothing overtakes it (but _admit_cached's few)
        return req if self._admit(req) else None

    def _admit(self, req: Request) -> bool:
        row = self.rows.alloc()
        if not self.memory.admit(req, row, self._reserve(req.left)):
            self.rows.free(row)
            return False
        self.queue.remove(req)
        req.row, req.phase = row, Phase.RUNNING
        self.running.append(req)
        return True

    def _admit_cached(self, step: BatchBuilder) -> int:
        """An agent's next turn: a queued request whose prompt the prefix cache mostly holds,
        and whose rest fits this step's prefill budget, is admitted first: before the prefills
        running and the prompts queued ahead of it, which would otherwise hold it for their
        whole length (8 agent sessions at once: a 99%-cached turn waited a minute behind the
        others' first prompts). It passes the queue's head only while that head has been
        passed fewer than MAX_OVERTAKES times, so a long prompt still gets its turn. Returns
        the budget used."""
        used = 0
        if self.memory.tree is None or not self.cached_first:
            return 0
        for req in list(islice(self.queue, SCAN_QUEUED)):
            if used >= self.chunk or not self.rows.available or not self.queue:
                break
            head = self.queue[0]
            if req is not head and head.overtaken >= MAX_OVERTAKES:
                break
            if req.group or req.scoring:
                continue
            left = self.memory.left_to_compute(req)
            if left > self.chunk - used or 2 * left > len(req.fill):
                continue  # longer than the step's budget, or mostly not cached
            if not self._admit(req):
                break  # memory is short: the head waits for it first
            if req is not head:
                head.overtaken += 1
            step.admit(req)
            used += self._prefill_chunk(req, self.chunk - used, step)
        return used

    def _prefill_chunk(self, req: Request, budget: int, step: BatchBuilder) -> int:
        n = min(len(req.fill) - req.filled, budget)
        end = next((e for e in req.chunk_ends if e > req.filled), 0)
        if end:
            n = min(n, end - req.filled)
        # A request admitted with its whole fill cached (memory.py) runs a last chunk of no
        # token: it only samples.
        if n <= 0 and req.prefilling:
            return 0
        last = req.filled + n == len(req.fill)
        step.prefill(req, req.fill[req.filled:req.filled + n], req.filled, last)
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
        return any(r.group == req.group and r.active and r.tree_len < len(r.fill) - 1
                   for r in self.running)

    def _decode_rows(self, step: BatchBuilder) -> None:
        for req in self._decodable():
            self.memory.cache_prompt(req, req.row)
            self.memory.grow(req, req.row, req.kv_len + 1)
            step.decode(req)
            req.kv_len += 1
            req.sampled += 1

    def _hold_decode(self) -> bool:
        """Prefill first: this step admits and prefills only, while more requests wait than
        rows decode and a row is free for the queue's head. A burst's requests then get their
        first tokens without each prefill step also paying for the decode rows admitted
        before them; decoding resumes once the decoders are as many as those waiting, or the
        rows are full, so it never waits on an endless stream."""
        if not self.prefill_first or not self.queue or not self.rows.available:
            return False
        return 0 < sum(map(self._would_decode, self.running)) < len(self.queue)

    def _decodable(self) -> list[Request]:
        """Running requests that get a decode row in the next step, after retracting the ones
        with least progress until every remaining one has room for its next token (a free
        page, for those whose pages are full)."""
        want = [r for r in self.running if self._would_decode(r)]
        while not self.memory.make_room(sum(r.pages_short(r.kv_len + 1) for r in want)):
            victim = pick_victim(self.running)
            if victim in want:
                want.remove(victim)
            if would_help(victim, self.requests.values()):
                victim.retracting = True
            else:
                self._finish(victim, "length")
            if victim.inflight == 0:
                self._settle(victim)
        return want

    def _reserve(self, left: int) -> int:
        return max(0, min(left, self.output_reserve))

    def _would_decode(self, req: Request) -> bool:
        """Running, past its prompt, its last sample a future input, and short of its limits."""
        return (req.active and not req.prefilling and self.futures.has_future(req)
                and self._wants_more(req))

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
        if req.phase is Phase.RUNNING and req.aborted:
            self._finish(req, "abort")
        if req.phase is Phase.DONE:
            self._release(req)
        elif req.retracting:
            self._requeue(req)

    def _requeue(self, req: Request, keep: bool = True) -> None:
        """Give back its memory and recompute it later from prompt + output so far (keep:
        what it computed stays cached)."""
        self._free_memory(req, keep)
        self.running.remove(req)
        recompute_later(req)
        self.retractions += 1
        self.queue.appendleft(req)
        self._out.retracted.append(req.rid)

    def _finish(self, req: Request, reason: str, message: str = "") -> None:
        req.phase = Phase.DONE
        req.finish_reason = reason
        if req in self.running:
            self.running.remove(req)
        self._out.finished.append(m.Finish(
            rid=req.rid, reason=reason, prompt_tokens=len(req.prompt),
            completion_tokens=len(req.output), cached_tokens=req.cached, message=message,
            stop_str=req.stop_str))

    def _release(self, req: Request, keep: bool = True) -> None:
        self._free_memory(req, keep)
        self.requests.pop(req.rid, None)

    def _free_memory(self, req: Request, keep: bool = True) -> None:
        # What it computed stays cached (prefix cache on) unless the runner failed under it.
        self.memory.release(req, req.row, keep=keep and req.finish_reason != "error")
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
        return not self.queue and not self.running and not self.futures

    def leaks(self) -> dict[str, list]:
        """When idle, every row is free, every KV and state slot is free or held by the prefix
        cache, no lock is held and no request remains: anything else leaked."""
        return {"rows": self.rows.leaked(), **self.memory.leaks(),
                "requests": sorted(self.requests)}


def joined(req_from: int, scores: list[m.PromptScores]) -> m.PromptScores:
    """A prompt's scored chunks as one run of positions (chunks land in order)."""
    start = scores[0].start if scores else max(req_from, 1)
    lps, top_ids, top_lps = [], [], []
    for s in scores:
        if s.start != start + len(lps):
            raise AssertionError(f"prompt scores at {s.start} after {start + len(lps)}")
        lps += s.logprobs
        top_ids += s.top_ids
        top_lps += s.top_logprobs
    return m.PromptScores(start=start, logprobs=lps, top_ids=top_ids, top_logprobs=top_lps)
