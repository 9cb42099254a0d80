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
