"""The runner's MLX thread never ends quietly: what its loop raises outside a step (rebuilding
the runner after a failed step, say) makes the actor die, so the launcher stops the graph
saying why, instead of every request waiting on a graph that looks up."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from actors.model_runner import actor
from protocol import messages as m
from protocol.config import load_config


class _Log:
    def __init__(self):
        self.events: list[tuple[str, dict]] = []

    def _record(self, event: str, **fields) -> None:
        self.events.append((event, fields))

    info = warning = error = exception = _record


class _Shell:
    def __init__(self):
        self.cfg, self.rank, self.log, self.sent = load_config(None), 0, _Log(), []

    def send_now(self, to: str, msg) -> None:
        self.sent.append((to, msg))


class _FailingRunner:
    pools = SimpleNamespace(kv=SimpleNamespace(held=dict))  # what the utilisation log reads

    def launch(self, batch):
        raise RuntimeError("the step failed")


def _batch(step: int) -> m.ForwardBatch:
    return m.ForwardBatch(step=step, rows=[0], input_lens=[1], start_pos=[0], future=[False],
                          sample=[True], input_ids=b"\x00\x00\x00\x00", follows=False)


def _thread(monkeypatch, rebuild) -> tuple[actor.MlxThread, list[str], asyncio.BaseEventLoop]:
    died: list[str] = []

    async def die(shell, message: str) -> None:  # the real one ends the process
        died.append(message)

    monkeypatch.setattr(actor, "die", die)
    loop = asyncio.new_event_loop()
    thread = actor.MlxThread(_Shell(), loop)
    thread.model, thread.runner = None, _FailingRunner()
    monkeypatch.setattr(thread, "_runner", rebuild)
    return thread, died, loop


def test_a_runner_that_cannot_be_rebuilt_kills_the_actor(monkeypatch):
    def rebuild(model):
        raise MemoryError("no memory for a new runner")

    thread, died, loop = _thread(monkeypatch, rebuild)
    thread.inbox.put(_batch(1))
    try:
        thread.serve_or_die()  # returns: the loop raised, the thread would end
        loop.run_until_complete(asyncio.sleep(0.05))  # the scheduled calls run
    finally:
        loop.close()
    assert died == ["the MLX thread failed: MemoryError('no memory for a new runner')"]
    events = [e for e, _ in thread.log.events]
    # The step's own failure went back as an error result first, as always.
    assert "step.error" in events and "runner.mlx_thread_failed" in events
    (to, result), = thread.shell.sent
    assert to == "scheduler" and result.step == 1 and "the step failed" in result.error


def test_a_failed_step_alone_still_only_fails_its_step(monkeypatch):
    rebuilt = []
    thread, died, loop = _thread(monkeypatch, lambda model: rebuilt.append(model) or
                                 _FailingRunner())
    thread.inbox.put(_batch(1))
    thread.inbox.put(_batch(2))
    thread.inbox.put(actor._STOP)
    try:
        thread.serve_or_die()  # returns at _STOP
        loop.run_until_complete(asyncio.sleep(0.05))
    finally:
        loop.close()
    assert died == [] and len(rebuilt) == 2
    assert [r.step for _, r in thread.shell.sent] == [1, 2]
    assert "runner.mlx_thread_failed" not in [e for e, _ in thread.log.events]
