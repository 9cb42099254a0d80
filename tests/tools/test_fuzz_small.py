"""The fuzz + soak job (tools/fuzz/job.py) against a real graph
on qwen3-tiny, through the job's own API. 140 ZMQ frames, 140 HTTP bodies and 100 soak requests
at concurrency 16: about half a minute on a 2-core machine. The full run is
`python -m tools.fuzz` (README, Benchmarks)."""

from __future__ import annotations

import json

import pytest

from tools.fuzz import job
from models.builtin import ensure_builtin

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def report(model_cache, tmp_path_factory):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    out = tmp_path_factory.mktemp("fuzz")
    args = job.parse_args([
        "--model", "qwen3-tiny", "--zmq-cases", "140", "--http-cases", "140",
        "--soak-requests", "100", "--concurrency", "16", "--timeout", "20",
        "--request-timeout", "60", "--canary-every-s", "10", "--seed", "1",
        "--log-dir", str(out), "--report", str(out / "report.json"), "--quiet"])
    result = job.run(args)
    (out / "report.json").write_text(json.dumps(result, indent=1, default=str))
    return result


def test_every_case_was_sent(report):
    assert report["zmq"]["cases"] == 140
    assert report["http"]["cases"] == 140
    assert report["soak"]["requests"] == 100
    assert report["soak"]["aborts"] > 0 and report["soak"]["zmq_disconnects"] > 0
    assert report["soak"]["http_closed"] > 0


def test_no_input_takes_the_server_down(report):
    failed = {c["name"]: c["detail"] for c in report["criteria"] if not c["ok"]}
    assert not failed, job.table(report)
