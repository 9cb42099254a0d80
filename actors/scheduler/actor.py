"""The scheduler actor: requests, aborts and step results in; ForwardBatches to the runner and
TokenBatches to the detokenizer out. One step in flight at a time (overlap is issue B)."""

from __future__ import annotations

import time

from actors.scheduler.core import Outputs, Scheduler
from actors.shell import Shell, run_actor
from protocol import messages as m
from protocol.codec import unpack_ids


class SchedulerActor:
    def __init__(self, shell: Shell):
        self.shell, self.log = shell, shell.log
        cfg = shell.cfg.scheduler
        self.core = Scheduler(max_running=cfg.max_running_requests,
                              max_prefill_tokens=cfg.max_prefill_tokens,
                              context_length=shell.model.context_length,
                              eos_ids=shell.model.eos_ids)
        self.inbox = shell.bind_inbox(m.SchedulerInbox)
        self.busy = False  # a step is in flight on the runner
        self.arrival: dict[str, float] = {}

    async def serve(self) -> None:
        await self.shell.ready()
        while True:
            out = Outputs()
            for msg in await self.inbox.recv_all():
                match msg:
                    case m.TokenizedRequest():
                        self.arrival[msg.rid] = time.monotonic()
                        self._merge(out, self.core.add(msg.rid, unpack_ids(msg.input_ids),
                                                       msg.params))
                    case m.Abort():
                        self.log.info("request.abort", rid=msg.rid)
                        self._merge(out, self.core.abort(msg.rid))
                    case m.StepResult():
                        self.busy = False
                        if msg.error:
                            self.log.error("step.failed", step=msg.step, error=msg.error)
                        self._merge(out, self.core.on_result(msg))
                    case m.Shutdown():
                        return
            if not self.busy:
                batch = self.core.schedule()
                if batch is not None:
                    await self.shell.send("runner", batch)
                    self.busy = True
                    self._log_admissions(batch)
                # schedule() ends aborted requests that had nothing in flight.
                self._merge(out, self.core.take())
            if out:
                await self.shell.send("detokenizer", out.to_batch())
                self._log_finished(out)
            if self.core.idle:
                self._check_idle()

    def _merge(self, into: Outputs, new: Outputs) -> None:
        for rid, toks in new.tokens.items():
            into.tokens.setdefault(rid, []).extend(toks)
        into.finished.extend(new.finished)

    def _log_admissions(self, batch: m.ForwardBatch) -> None:
        for row, n, fut in zip(batch.rows, batch.input_lens, batch.future):
            if fut:
                continue
            req = next(r for r in self.core.running if r.row == row)
            wait = time.monotonic() - self.arrival.get(req.rid, time.monotonic())
            self.log.info("request.admitted", rid=req.rid, row=row, prompt_tokens=n,
                          queue_s=round(wait, 6), step=batch.step)

    def _log_finished(self, out: Outputs) -> None:
        for fin in out.finished:
            self.arrival.pop(fin.rid, None)
            self.log.info("request.ended", rid=fin.rid, reason=fin.reason,
                          prompt_tokens=fin.prompt_tokens,
                          completion_tokens=fin.completion_tokens)

    def _check_idle(self) -> None:
        leaks = self.core.leaks()
        if any(leaks.values()):
            self.log.error("scheduler.leak", **leaks)


async def serve(shell: Shell) -> None:
    await SchedulerActor(shell).serve()


def main(cfg, addrs, model) -> None:
    run_actor("scheduler", cfg, addrs, model, serve)
