"""The FutureMap, scheduler side (docs/architecture.md, section 5): which rows' inputs are
futures, and the steps in flight that pin what they touch.

A decode row never carries its input token: its input is "whatever this row sampled last",
which the runner resolves from its token buffer (`token_buf[row]`, model_runner/rows.py). So
step N+1 can be built and sent before step N's tokens are known (overlap). The map is indexed by
the request-pool row, which the request keeps from admission to release, so a future can never
resolve to another request's token.

What a built step references (the row, its KV pages and state slot) stays allocated until that step
returns: each step in flight pins the requests it carries (`Request.inflight`), and a request is
released only at zero. Results come back in step order, one per step.
"""

from __future__ import annotations

from collections import deque

from actors.scheduler.request import Request
from protocol import messages as m


class FutureMap:
    def __init__(self):
        self.in_flight: deque[tuple[m.ForwardBatch, list[Request]]] = deque()

    def __len__(self) -> int:
        """Steps sent and not yet returned."""
        return len(self.in_flight)

    @staticmethod
    def has_future(req: Request) -> bool:
        """The row's token buffer holds (or a step in flight will write) its last sample, so
        it can decode with a future input."""
        return req.sampled > 0

    def launch(self, batch: m.ForwardBatch, carried: list[Request]) -> None:
        """A step is sent: pin every request it carries."""
        for req in carried:
            req.inflight += 1
        self.in_flight.append((batch, carried))

    def oldest(self) -> m.ForwardBatch:
        """The step the next result answers."""
        return self.in_flight[0][0]

    def land(self, result: m.StepResult) -> list[tuple[Request, int | None]]:
        """The oldest step returned: unpin what it carried. Per carried request, in row order,
        the index of its token in `result.tokens` (None: the row did not sample, or the step
        failed)."""
        batch, carried = self.in_flight.popleft()
        if result.step != batch.step:
            raise AssertionError(f"result for step {result.step}, expected {batch.step}")
        landed: list[tuple[Request, int | None]] = []
        k = -1  # index of this row's sample in the result
        for req, samples in zip(carried, batch.sample):
            req.inflight -= 1
            k += samples
            landed.append((req, k if samples and not result.error else None))
        return landed

    def pinned(self) -> list[tuple[m.ForwardBatch, list[Request]]]:
        """The steps in flight with the requests they pin, oldest first (for checks)."""
        return list(self.in_flight)
