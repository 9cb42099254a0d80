"""The runner actor's step pipeline: step N+1 is built before step N is read back, N's result
still goes out first (and before N+1 waits for MLX), and a failure ends exactly the steps it
touched. The runner is faked (it records calls); the Pipeline under test is the real one."""

from __future__ import annotations

from actors.model_runner.pipeline import Pipeline, before_host_sync
from protocol import messages as m


class FakeRunner:
    def __init__(self, calls: list, waits=(), bad_launch=(), bad_finish=()):
        self.calls, self.waits = calls, set(waits)
        self.bad_launch, self.bad_finish = set(bad_launch), set(bad_finish)

    def launch(self, batch: m.ForwardBatch):
        self.calls.append(("launch", batch.step))
        if batch.step in self.waits:  # this step needs MLX values while it is built
            before_host_sync()
            before_host_sync()  # a second wait in the same step flushes nothing more
            self.calls.append(("waited", batch.step))
        if batch.step in self.bad_launch:
            raise RuntimeError(f"launch {batch.step}")
        return batch.step

    def finish(self, step: int) -> m.StepResult:
        self.calls.append(("finish", step))
        if step in self.bad_finish:
            raise RuntimeError(f"finish {step}")
        return m.StepResult(step=step, rows=[1], tokens=[step])


class FakeLog:
    def error(self, *_, **__):
        pass


class FakeThread:
    def __init__(self, **faults):
        self.calls: list = []
        self.runner = FakeRunner(self.calls, **faults)
        self.log = FakeLog()

    def send(self, result: m.StepResult, started: float) -> None:
        self.calls.append(("send", result.step, "error" if result.error else "ok"))

    def reset(self) -> None:
        self.calls.append(("reset",))
        self.runner.bad_finish.clear()


def batch(step: int) -> m.ForwardBatch:
    return m.ForwardBatch(step=step, rows=[], input_lens=[], start_pos=[], future=[],
                          sample=[], input_ids=b"")


def test_the_next_step_is_built_before_the_last_is_read_and_results_stay_in_order():
    t = FakeThread()
    p = Pipeline(t)
    for step in (1, 2, 3):
        p.launch(batch(step))
    assert p.busy
    p.flush()
    assert not p.busy
    assert t.calls == [("launch", 1), ("launch", 2), ("finish", 1), ("send", 1, "ok"),
                       ("launch", 3), ("finish", 2), ("send", 2, "ok"),
                       ("finish", 3), ("send", 3, "ok")]


def test_the_last_result_goes_out_before_the_next_step_waits_for_mlx():
    t = FakeThread(waits=[2])
    p = Pipeline(t)
    p.launch(batch(1))
    p.launch(batch(2))
    p.flush()
    assert t.calls == [("launch", 1), ("launch", 2), ("finish", 1), ("send", 1, "ok"),
                       ("waited", 2), ("finish", 2), ("send", 2, "ok")]


def test_a_step_that_fails_to_build_ends_alone_after_the_one_before():
    t = FakeThread(bad_launch=[2])
    p = Pipeline(t)
    for step in (1, 2, 3):
        p.launch(batch(step))
    p.flush()
    assert t.calls == [("launch", 1), ("launch", 2), ("finish", 1), ("send", 1, "ok"),
                       ("send", 2, "error"), ("reset",),
                       ("launch", 3), ("finish", 3), ("send", 3, "ok")]


def test_a_step_that_fails_to_read_back_fails_the_step_built_on_it():
    t = FakeThread(waits=[2], bad_finish=[1])
    p = Pipeline(t)
    for step in (1, 2, 3):
        p.launch(batch(step))
    p.flush()
    assert t.calls == [("launch", 1), ("launch", 2), ("finish", 1), ("send", 1, "error"),
                       ("waited", 2), ("send", 2, "error"), ("reset",),
                       ("launch", 3), ("finish", 3), ("send", 3, "ok")]


def test_a_failed_read_back_with_nothing_else_launched_resets_at_once():
    t = FakeThread(bad_finish=[1])
    p = Pipeline(t)
    p.launch(batch(1))
    p.flush()
    p.launch(batch(2))
    p.flush()
    assert t.calls == [("launch", 1), ("finish", 1), ("send", 1, "error"), ("reset",),
                       ("launch", 2), ("finish", 2), ("send", 2, "ok")]
