"""The scheduler actor: requests, aborts and step results in; ForwardBatches to the runner and
TokenBatches to the detokenizer out.

Overlap (scheduler.overlap, the default): up to two steps are in flight, so when step N's result
arrives the runner is already running step N+1; the scheduler processes N's result and builds
N+2 while it does. Without overlap, one step at a time.

At startup the scheduler waits for the runner's ModelLayers (what each layer of the loaded model
keeps): the prefix cache it builds its core with depends on them (prefix_plan.py).
"""

from __future__ import annotations

import time

import msgspec

from actors.scheduler.core import Scheduler
from actors.scheduler.outputs import Outputs
from actors.scheduler.prefix_plan import plan_prefix
from actors.shell import Shell, run_actor
from models.sizing import kv_capacity, state_capacity
from models.tokenizer import load_decoder
from protocol import messages as m
from protocol.codec import unpack_ids
from protocol.messages import KV_PAGE


class SchedulerActor:
    def __init__(self, shell: Shell):
        self.shell, self.log = shell, shell.log
        self.depth = 2 if shell.cfg.scheduler.overlap else 1
        self.inbox = shell.bind_inbox(m.SchedulerInbox)
        self.arrival: dict[str, float] = {}
        self.was_idle = True
        self.admitted_tokens = self.interval_hits = 0
        # Loaded now, while the runner loads the model (~0.5 s of the launch otherwise).
        self.decode = load_decoder(shell.model.path)

    def _build_core(self, layers: m.ModelLayers) -> Scheduler:
        cfg, model = self.shell.cfg, self.shell.model
        plan = plan_prefix(layers.kinds, cfg.cache.prefix)
        if plan.blocked and cfg.cache.prefix:
            self.log.warning("cache.prefix_off", layers=plan.blocked, reason=plan.reason)
        return Scheduler(max_running=cfg.scheduler.max_running_requests,
                         context_length=model.context_length, eos_ids=model.eos_ids,
                         chunked_prefill_size=cfg.scheduler.chunked_prefill_size,
                         kv_slots=kv_capacity(cfg, model), state_slots=state_capacity(cfg, model),
                         prefix_cache=plan.prefix, share_groups=plan.share_groups,
                         snapshot_interval=cfg.cache.snapshot_interval,
                         max_queued=cfg.scheduler.max_queued_requests,
                         output_reserve=cfg.scheduler.output_reserve_tokens,
                         decode=self.decode, head_input=layers.head_input,
                         prefill_first=cfg.scheduler.prefill_first,
                         cached_first=cfg.scheduler.cached_first)

    async def _await_layers(self) -> tuple[m.ModelLayers, list] | None:
        """The runner's ModelLayers, and every message that came before it (kept, in order,
        to be handled once the core exists); None if told to shut down first."""
        timeout = self.shell.cfg.launch.ready_timeout_s
        deadline, early = time.monotonic() + timeout, []
        while (left := deadline - time.monotonic()) > 0:
            msgs = await self.inbox.recv_all(timeout=left)
            for i, msg in enumerate(msgs):
                match msg:
                    case m.ModelLayers():
                        return msg, early + msgs[i + 1:]
                    case m.Shutdown():
                        return None  # the runner never loaded: nothing here to drain
                    case _:
                        early.append(msg)
        raise TimeoutError(f"no ModelLayers from the runner within {timeout:g} s "
                           "(launch.ready_timeout_s)")

    async def serve(self) -> None:
        got = await self._await_layers()
        if got is None:
            return
        layers, msgs = got
        self.core = self._build_core(layers)
        self.stats_at, self.last_stats = time.monotonic(), self.core.memory.stats()
        mem = self.core.memory
        self.log.info("scheduler.config", overlap=self.depth == 2, kv_slots=mem.kv.capacity,
                      kv_pages=mem.kv.pages_total, kv_page_tokens=KV_PAGE,
                      state_slots=mem.states.capacity if mem.states else 0,
                      prefix_cache=mem.prefix, share_groups=mem.tree is not None,
                      rows=self.core.rows.size, chunked_prefill_size=self.core.chunk)
        await self.shell.ready()
        while True:
            out = Outputs()
            for msg in msgs or await self.inbox.recv_all():
                match msg:
                    case m.TokenizedRequest():
                        self.arrival[msg.rid] = time.monotonic()
                        added = self.core.add(msg.rid, unpack_ids(msg.input_ids), msg.params,
                                              group=msg.group)
                        # A refused one ends at once (request.ended), never queued.
                        if not any(f.rid == msg.rid for f in added.finished):
                            self.log.info("request.queued", rid=msg.rid,
                                          queued=len(self.core.queue))
                            # Busy since the last check, even if its abort in this same read
                            # leaves the core idle again: the idle check then runs.
                            self.was_idle = False
                        out.merge(added)
                    case m.Abort():
                        self.log.info("request.abort", rid=msg.rid)
                        out.merge(self.core.abort(msg.rid))
                    case m.StepResult():
                        if msg.error:
                            self.log.error("step.failed", step=msg.step, error=msg.error)
                        self.log.debug("step.done", step=msg.step, rows=len(msg.rows),
                                       forward_s=round(msg.forward_s, 5))
                        out.merge(self.core.on_result(msg))
                    case m.Shutdown():
                        return
            msgs = []
            # Retractions (a result can settle one) are logged before the admissions of the
            # same pass: a request retracted and admitted again reads in order.
            logged = self._log_retractions(out, 0)
            # Tokens and endings from these messages go out before the next step is built:
            # the runner has the step in flight (or nothing to run until they are read), and
            # a client waits on them. What scheduling adds (refusals, aborts) follows below.
            if out:
                self._emit(out)
                out, logged = Outputs(), 0
            batch = self._next_batch()
            while batch is not None:
                # The next step is built before this one goes. Where none could be built with
                # room in flight (nothing to run until a result is in), the runner reads this
                # one back at once instead of waiting for a next step to overlap with.
                following = self._next_batch()
                follows = following is not None or len(self.core.futures) >= self.depth
                await self.shell.send("runner", msgspec.structs.replace(batch, follows=follows))
                if batch.hold_decode:
                    self.log.debug("step.hold_decode", step=batch.step,
                                   queued=len(self.core.queue))
                out.merge(self.core.take())
                logged = self._log_retractions(out, logged)
                self._log_admissions(batch)
                batch = following
            # schedule() ends aborted requests that had nothing in flight.
            out.merge(self.core.take())
            self._log_retractions(out, logged)
            if out:
                self._emit(out)
            self._log_cache()
            self._check_idle()

    def _emit(self, out: Outputs) -> None:
        self._log_endings(out)  # request.ended before the tokenizer's request.finished
        stats = self.core.memory.stats()
        self.shell.send_now("detokenizer", out.to_batch(
            running=len(self.core.running), queued=len(self.core.queue),
            replica=self.shell.replica,
            kv_pages=[stats[k] for k in ("pages_total", "pages_used", "pages_cached",
                                         "pages_free")]))

    def _next_batch(self) -> m.ForwardBatch | None:
        return self.core.schedule() if len(self.core.futures) < self.depth else None

    def _log_admissions(self, batch: m.ForwardBatch) -> None:
        admitted = set(batch.admit_rows)
        for req in self.core.running:
            if req.row in admitted:
                wait = time.monotonic() - self.arrival.get(req.rid, time.monotonic())
                self.log.info("request.admitted", rid=req.rid, row=req.row,
                              prompt_tokens=len(req.fill), cached_tokens=req.tree_len,
                              queue_s=round(wait, 6), step=batch.step,
                              retractions=req.retractions)
                self.admitted_tokens += len(req.fill)
                if req.tree_len:
                    self.log.info("cache.hit", rid=req.rid, cached_tokens=req.tree_len,
                                  prompt_tokens=len(req.fill))
        for row, n, start, fut, smp in zip(batch.rows, batch.input_lens, batch.start_pos,
                                           batch.future, batch.sample):
            if not fut and not (start == 0 and smp):
                req = next((r for r in self.core.running if r.row == row), None)
                # Info, not debug: one per chunk of a prompt split in chunks (or the rest of a
                # prompt after a prefix hit), never per token.
                self.log.info("request.prefill_chunk", rid=req.rid if req else None, row=row,
                              start=start, tokens=n, last=smp, step=batch.step)

    def _log_retractions(self, out: Outputs, logged: int) -> int:
        """Log out.retracted[logged:]; returns how many of out.retracted are logged now."""
        for rid in out.retracted[logged:]:
            self.log.warning("request.retracted", rid=rid, free_slots=self.core.kv.available)
        return len(out.retracted)

    def _log_endings(self, out: Outputs) -> None:
        for fin in out.finished:
            self.arrival.pop(fin.rid, None)
            self.log.info("request.ended", rid=fin.rid, reason=fin.reason,
                          prompt_tokens=fin.prompt_tokens,
                          completion_tokens=fin.completion_tokens,
                          cached_tokens=fin.cached_tokens, error=fin.message or None)

    def _log_cache(self) -> None:
        """Inserts and evictions as they happen; the hit rate per stats interval."""
        now, stats = time.monotonic(), self.core.memory.stats()
        last = self.last_stats
        if stats["evicted_tokens"] > last["evicted_tokens"]:
            self.log.info("cache.evict", tokens=stats["evicted_tokens"] - last["evicted_tokens"],
                          cached_tokens=stats["cached_tokens"])
        if stats["inserted_tokens"] > last["inserted_tokens"]:
            self.log.debug("cache.insert", tokens=stats["inserted_tokens"] - last["inserted_tokens"],
                           cached_tokens=stats["cached_tokens"])
        if now - self.stats_at >= self.shell.cfg.log.stats_interval_s and self.admitted_tokens:
            hits = stats["hit_tokens"] - self.interval_hits
            self.log.info("cache.stats", hit_rate=round(hits / self.admitted_tokens, 4),
                          hit_tokens=hits, prompt_tokens=self.admitted_tokens,
                          cached_tokens=stats["cached_tokens"], free_slots=stats["free_slots"],
                          pages_free=stats["pages_free"], pages_used=stats["pages_used"],
                          pages_cached=stats["pages_cached"])
            self.stats_at, self.admitted_tokens, self.interval_hits = now, 0, stats["hit_tokens"]
        self.last_stats = stats

    def _check_idle(self) -> None:
        """Idle: every row and slot must be back on its free list; else log the leaked ids."""
        idle = self.core.idle
        if idle and not self.was_idle:
            leaks = self.core.leaks()
            if any(leaks.values()):
                self.log.error("scheduler.leak", **leaks)
            else:
                self.log.info("scheduler.idle", free_rows=self.core.rows.available,
                              free_slots=self.core.kv.available)
        self.was_idle = idle


async def serve(shell: Shell) -> None:
    await SchedulerActor(shell).serve()


def main(cfg, addrs, model, name: str = "scheduler") -> None:
    """`name`: "scheduler", or "scheduler.R" for data-parallel replica R."""
    run_actor(name, cfg, addrs, model, serve)
