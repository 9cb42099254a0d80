"""The overlap pipeline (docs/architecture.md, section 9): at most one launched step whose result is
not read back yet, and the "before host sync" hook that keeps it from waiting behind the next.

Launching step N+1 first and then reading step N back keeps the MLX stream fed while Python
builds graphs, as mlx_lm.generate's async_eval loop does. But building N+1 sometimes has to
wait for MLX values itself: fastmath's NumPy softmax and SiLU, mlx-lm's filter reading a
sliding-window batch's paddings back, a prompt chunk evaluating its caches, and on the CPU
queueing the step itself (MLX's CPU eval computes most of a graph before async_eval returns).
Those places call before_host_sync(): the first one in a launch flushes step N (reads it back
and sends its result), so the scheduler gets N as soon as it is done, not after N+1 is
built. Outside a pipeline's launch (tests, benchmarks) before_host_sync() does nothing.
"""

from __future__ import annotations

import time
import traceback
from contextlib import contextmanager
from typing import Any, Callable, Iterator

from actors.model_runner.thread_flag import ThreadFlag
from protocol import messages as m

# Set on the MLX thread only: it alone builds steps.
_flush: ThreadFlag[Callable[[], None] | None] = ThreadFlag(None)


@contextmanager
def flush_before_host_sync(flush: Callable[[], None]) -> Iterator[None]:
    """While a step is built inside this block, `flush` runs once, at the first
    before_host_sync() on this thread."""
    with _flush.holding(flush):
        yield


def before_host_sync() -> None:
    """About to block on MLX values while building a step: flush the previous step first."""
    flush = _flush.get()
    if flush is not None:
        _flush.set(None)  # once per launch: after the flush nothing is pending
        flush()


class Pipeline:
    """Launches steps on `thread.runner` and sends their results through `thread.send`, in
    step order; `thread.reset()` drops the runner's memory after a failure, which ends exactly
    the failed step and the one built on it."""

    def __init__(self, thread: Any):
        self.thread = thread  # the MLX thread: runner, send(result, started), reset(), log
        self.pending: tuple[m.ForwardBatch, Any, float] | None = None
        self.launching = False
        self.failed = False  # the pending step failed while the next one was being built

    @property
    def busy(self) -> bool:
        return self.pending is not None

    def flush(self) -> None:
        """Read the pending step back and send its result."""
        if self.pending is None:
            return
        batch, launched, started = self.pending
        self.pending = None
        try:
            result = self.thread.runner.finish(launched)
        except Exception as e:
            self.thread.send(self._error(batch, e), started)
            if self.launching:
                self.failed = True  # reset once the step being built is abandoned
            else:
                self.thread.reset()
            return
        self.thread.send(result, started)

    def launch(self, batch: m.ForwardBatch) -> None:
        started = time.perf_counter()
        self.launching = True
        launched, error = None, None
        try:
            with flush_before_host_sync(self.flush):
                launched = self.thread.runner.launch(batch)
        except Exception as e:
            error = e
        finally:
            self.launching = False
        self.flush()  # the earlier step's result first: the scheduler expects them in order
        if error is None and self.failed:
            error = RuntimeError("the step it was built on failed")
        if error is not None:
            self.thread.send(self._error(batch, error), started)
            self.thread.reset()
            self.failed = False
            return
        self.pending = (batch, launched, started)

    def _error(self, batch: m.ForwardBatch, e: Exception) -> m.StepResult:
        # The scheduler ends the requests of this step with the error.
        self.thread.log.error("step.error", step=batch.step, error=repr(e),
                              traceback="".join(traceback.format_exception(e)))
        return m.StepResult(step=batch.step, rows=[], tokens=[], error=repr(e))
