"""Every log record, from any thread, carries actor and pid; the file gets JSON lines."""

import json
import os
import threading

from actors.logs import configure_logging, get_logger
from protocol.config import LogConfig


def test_records_from_every_thread_carry_actor_and_pid(tmp_path):
    path = tmp_path / "x" / "log.jsonl"
    configure_logging(LogConfig(stderr=False, file=str(path)), "runner")
    get_logger().info("step.done", step=3)
    worker = threading.Thread(target=lambda: get_logger(rid="r1").warning("request.retracted"))
    worker.start()
    worker.join()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["event"] for r in records] == ["step.done", "request.retracted"]
    assert all(r["actor"] == "runner" and r["pid"] == os.getpid() for r in records)
    assert records[0]["step"] == 3 and records[1]["rid"] == "r1"
    assert records[1]["level"] == "warning" and "timestamp" in records[1]


def test_level_filters(tmp_path):
    path = tmp_path / "log.jsonl"
    configure_logging(LogConfig(stderr=False, file=str(path), level="warning"), "scheduler")
    get_logger().info("quiet")
    get_logger().error("loud")
    assert [json.loads(line)["event"] for line in path.read_text().splitlines()] == ["loud"]


def test_runner_utilisation_logs_its_last_short_interval_at_shutdown():
    """An interval is logged once it is over, and at shutdown however short it was (a run
    shorter than log.stats_interval_s would otherwise leave no runner.utilisation at all)."""
    from actors.model_runner.actor import Utilisation

    class Log:
        def __init__(self):
            self.events = []

        def info(self, event, **fields):
            self.events.append((event, fields))

    log = Log()
    stats = Utilisation(log, interval=3600.0)
    stats.step(0.01, tokens=4)
    stats.maybe_report()
    assert log.events == []  # the interval is not over
    stats.maybe_report(final=True)
    assert [e for e, _ in log.events] == ["runner.utilisation"]
    assert log.events[0][1]["steps"] == 1 and log.events[0][1]["busy_s"] == 0.01
    stats.maybe_report(final=True)  # nothing ran since: nothing more
    assert len(log.events) == 1
