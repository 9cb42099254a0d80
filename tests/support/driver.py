"""The one loop that plays the runner's side of the scheduler handshake, for every test that
drives the scheduler core (actors/scheduler/core.py): build a step (schedule), hand it to a
runner (`runner.step(batch) -> StepResult`: the real ModelRunner, a fake one here, or a test's
own), land the results oldest first (on_result), and collect what the scheduler answers. A
change in that handshake is fixed here, once. Pure: importing this imports no model."""

from __future__ import annotations

from collections import deque

from protocol import messages as m
from protocol.codec import unpack_ids


class Scripted:
    """A fake runner: each sampled row gets the next token of its request's script; past it,
    `default`, or else 1000 + the token's index in the output (no EOS: the request ends by
    length). A batch names rows only, so it asks the scheduler which request holds a row, and
    counts each row's tokens from its admission (admit_generated: where a retracted request's
    output resumes)."""

    def __init__(self, sched, scripts=None, default=None):
        self.sched, self.scripts, self.default = sched, scripts or {}, default
        self.index: dict[int, int] = {}  # row -> output index of the next token it samples

    def step(self, batch: m.ForwardBatch) -> m.StepResult:
        self.index.update(zip(batch.admit_rows, batch.admit_generated))
        rid = {r.row: r.rid for r in self.sched.requests.values() if r.row}
        rows = [row for row, sample in zip(batch.rows, batch.sample) if sample]
        tokens = []
        for row in rows:
            i = self.index[row]
            self.index[row] += 1
            script = self.scripts.get(rid[row], [])
            tokens.append(script[i] if i < len(script)
                          else 1000 + i if self.default is None else self.default)
        return m.StepResult(step=batch.step, rows=rows, tokens=tokens)


class Driver:
    """Drives `sched` against `runner` (default: Scripted, no scripts) with up to `depth` steps
    in flight (2 plays the actors' overlap: step N+1 is built before step N's result lands).
    `check(sched)`, if given, runs after every build and every landing. Collected: tokens and
    prompt scores per rid, Finish per rid (in the order they came), every batch built."""

    def __init__(self, sched, runner=None, depth=1, check=None):
        self.sched, self.depth, self.check = sched, depth, check
        self.runner = runner if runner is not None else Scripted(sched)
        self.tokens: dict[str, list[int]] = {}
        self.scores: dict[str, m.PromptScores] = {}
        self.finished: dict[str, m.Finish] = {}
        self.batches: list[m.ForwardBatch] = []
        self.results: deque[m.StepResult] = deque()  # the runner's answers not landed yet

    def collect(self, out):
        """What the scheduler answered (add, abort, schedule, on_result): each request gets its
        tokens before its one terminal reply, and nothing after it."""
        for rid, toks in out.tokens.items():
            assert rid not in self.finished, f"{rid} got tokens after its terminal reply"
            self.tokens.setdefault(rid, []).extend(toks)
        for rid, got in out.prompt_scores.items():
            assert rid not in self.scores, f"{rid} got its prompt scores twice"
            self.scores[rid] = got
        for fin in out.finished:
            assert fin.rid not in self.finished, f"{fin.rid} got two terminal replies"
            self.finished[fin.rid] = fin
        return out

    def add(self, rid, prompt, params, group=""):
        return self.collect(self.sched.add(rid, prompt, params, group=group))

    def abort(self, rid):
        return self.collect(self.sched.abort(rid))

    def build(self) -> m.ForwardBatch | None:
        """One schedule(); a batch built goes to the runner at once, its result held to land
        in order (a test may look at the batch, or build more, before landing it)."""
        batch = self.sched.schedule()
        self.collect(self.sched.take())  # schedule() may end requests (aborts, retractions)
        if batch is not None:
            self.batches.append(batch)
            check_batch(self.sched, batch)
            self.results.append(self.runner.step(batch))
        if self.check:
            self.check(self.sched)
        return batch

    def send(self) -> m.ForwardBatch | None:
        """Build until `depth` steps are in flight or nothing is left to build; the last built."""
        last = None
        while len(self.sched.futures) < self.depth and (batch := self.build()) is not None:
            last = batch
        return last

    def land(self):
        """The oldest step's result back to the scheduler: its Outputs, None if none waits."""
        if not self.results:
            return None
        out = self.collect(self.sched.on_result(self.results.popleft()))
        if self.check:
            self.check(self.sched)
        return out

    def step(self, late=False) -> m.ForwardBatch | None:
        """One wake of the scheduler actor: build, then land the oldest result (late: land,
        then build, so that arrivals and aborts meet `depth` steps in flight). The last batch
        built, None if none."""
        if late:
            self.land()
        batch = self.send()
        if not late:
            self.land()
        return batch

    def run(self, arrivals=None, limit=3000):
        """Steps until, after the last arrival, nothing is queued, running or in flight (the
        last releases have reached the runner). arrivals: tick -> [(rid, ids, max_new or
        SamplingParams[, group])], added at the start of that tick. Returns the driver."""
        arrivals = arrivals or {}
        last = max(arrivals, default=-1)
        for tick in range(limit):
            for rid, ids, n, *group in arrivals.get(tick, []):
                params = n if isinstance(n, m.SamplingParams) else m.SamplingParams(
                    max_new_tokens=n)
                self.add(rid, ids, params, *group)
            self.send()
            if tick > last and self.sched.idle:
                return self
            self.land()
        raise AssertionError(f"the scheduler is not idle after {limit} steps")


def check_batch(sched, batch: m.ForwardBatch) -> None:
    """What every batch must hold, whatever the runner: rows distinct, owned and not the
    padding row 0, and one input id per token of the rows that are not futures."""
    assert len(set(batch.rows)) == len(batch.rows), "a row twice in one step"
    assert 0 not in batch.rows, "row 0 is padding"
    owned = {r.row for r in sched.requests.values() if r.row}
    assert set(batch.rows) <= owned
    assert len(owned) <= sched.rows.size
    ids = unpack_ids(batch.input_ids)
    assert len(ids) == sum(n for n, f in zip(batch.input_lens, batch.future) if not f)
