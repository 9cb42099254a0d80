"""`launch logs`: the pure core on hand-written records (timeline order and gaps, the summary's
numbers, filters, time bounds), the run files (naming, pruning, rotation, several processes
appending while the launcher rotates), and the CLI on a written file."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest

from actors.logs import AppendFile
from launch import cli
from launch.logs.events import Filter, parse_line, parse_records, parse_when, select
from launch.logs.files import backups, latest_run, prune_runs, rotate, run_file, run_file_name
from launch.logs.read import follow, read_records
from launch.logs.summary import percentiles, summarize
from launch.logs.timeline import find_rids, timeline
from protocol.config import LogConfig

T0 = 1_750_000_000.0  # any fixed instant


def line(t: float, event: str, actor: str = "scheduler", level: str = "info", **fields) -> str:
    stamp = datetime.fromtimestamp(T0 + t, timezone.utc).isoformat().replace("+00:00", "Z")
    return json.dumps({**fields, "event": event, "actor": actor, "pid": 100, "level": level,
                       "timestamp": stamp})


def one_request(rid: str, t: float, *, reason: str = "stop", prompt: int = 10, out: int = 5,
                ttft: float = 0.1, total: float = 0.5, cached: int = 0, retracted: int = 0,
                chunks: int = 0, req_id: str | None = None) -> list[str]:
    """The records one request leaves, as the four actors log them."""
    lines = [line(t, "request.received", "tokenizer", rid=rid, req_id=req_id or rid,
                  prompt_tokens=prompt),
             line(t + 0.001, "request.queued", rid=rid, queued=1),
             line(t + 0.002, "request.admitted", rid=rid, row=1, prompt_tokens=prompt,
                  cached_tokens=cached, queue_s=0.001, step=1, retractions=0)]
    lines += [line(t + 0.003 + k * 0.001, "request.prefill_chunk", rid=rid, row=1,
                   start=k * 4, tokens=4) for k in range(chunks)]
    lines.append(line(t + ttft, "request.first_token", "tokenizer", rid=rid, ttft_s=ttft))
    lines += [line(t + ttft + 0.01 * (k + 1), "request.retracted", level="warning", rid=rid,
                   free_slots=0) for k in range(retracted)]
    lines.append(line(t + total - 0.001, "request.ended", rid=rid, reason=reason,
                      prompt_tokens=prompt, completion_tokens=out, cached_tokens=cached))
    lines.append(line(t + total, "request.finished", "tokenizer", rid=rid, reason=reason,
                      prompt_tokens=prompt, completion_tokens=out, cached_tokens=cached,
                      ttft_s=ttft, total_s=total))
    return lines


# -- the pure core -------------------------------------------------------------------------------


def test_a_timeline_is_in_time_order_across_actors_with_the_gaps_between_steps():
    lines = one_request("t-1", 0.0, chunks=2, retracted=1, req_id="mine")
    lines += one_request("t-2", 0.05)
    lines.reverse()  # as if several files were read in some other order
    records = parse_records(lines)
    assert find_rids(records, "t-1") == ["t-1"]
    assert find_rids(records, "mine") == ["t-1"]  # a client's req_id names its request too
    assert find_rids(records, "nobody") == []
    steps = timeline(records, "t-1")
    assert [s.event for s in steps] == [
        "request.received", "request.queued", "request.admitted", "request.prefill_chunk",
        "request.prefill_chunk", "request.first_token", "request.retracted", "request.ended",
        "request.finished"]
    assert [s.actor for s in steps][:2] == ["tokenizer", "scheduler"]
    assert steps[0].gap == 0 and steps[0].since_start == 0
    for before, after in zip(steps, steps[1:]):
        assert after.gap == pytest.approx(after.t - before.t)
        assert after.since_start == pytest.approx(after.t - steps[0].t)
        assert after.gap >= 0
    assert steps[-1].since_start == pytest.approx(0.5, abs=1e-6)
    assert steps[2].fields == {"row": 1, "prompt_tokens": 10, "cached_tokens": 0,
                               "queue_s": 0.001, "step": 1, "retractions": 0}
    assert steps[-1].as_dict()["gap_s"] == pytest.approx(0.001, abs=1e-6)


def test_the_summary_counts_requests_tokens_latencies_cache_and_problems():
    lines = []
    for k in range(4):  # ttft 0.1 .. 0.4, total 1.0 .. 4.0, 11 tokens each
        lines += one_request(f"s-{k}", k * 0.5, ttft=0.1 * (k + 1), total=1.0 * (k + 1),
                             out=11, prompt=20, cached=5 if k % 2 else 0)
    lines += one_request("a-1", 1.0, reason="abort", out=3, total=0.3, retracted=2)
    lines += one_request("l-1", 1.5, reason="length", out=7, chunks=3)
    lines.append(line(2.0, "request.received", "tokenizer", rid="open-1", prompt_tokens=4))
    lines.append(line(2.1, "request.rejected", "tokenizer", level="warning", req_id="x",
                      error="empty prompt", code=400))
    lines.append(line(2.2, "step.failed", level="error", step=9, error="boom"))
    lines.append(line(2.3, "step.failed", level="error", step=10, error="boom again"))
    lines += [line(5.0 * (k + 1), "runner.utilisation", "runner", busy_fraction=0.5,
                   busy_s=2.5, wall_s=5.0, steps=10, tokens_per_s=20.0) for k in range(4)]
    s = summarize(parse_records(lines), slowest=2)

    assert s["requests"]["by_reason"] == {"abort": 1, "length": 1, "stop": 4}
    assert s["requests"]["ended"] == 6 and s["requests"]["open"] == 1
    assert s["requests"]["rejected"] == 1 and s["requests"]["chunked"] == 1
    assert s["tokens"] == {"prompt": 4 * 20 + 10 + 10, "completion": 44 + 3 + 7,
                           "cached": 10, "completion_per_s": pytest.approx(54 / 20.0)}
    assert s["prefix_cache"]["hit_rate"] == pytest.approx(10 / 100)
    assert s["retractions"] == {"count": 2, "requests": 1}
    ttft = s["latency_s"]["ttft"]
    assert ttft["count"] == 6 and ttft["max"] == pytest.approx(0.4)
    e2e = s["latency_s"]["e2e"]
    assert e2e["p50"] == pytest.approx(1.5)  # 0.3 0.5 1 | 2 3 4: between 1 and 2
    assert e2e["max"] == 4.0 and e2e["count"] == 6
    # Inter-token: (total - ttft) / (out - 1) per request: s-3 (4.0 - 0.4) / 10 is the most,
    # l-1 (0.5 - 0.1) / 6 the least.
    itl = s["latency_s"]["itl"]
    assert itl["count"] == 6 and itl["max"] == pytest.approx(0.36)
    assert itl["mean"] == pytest.approx((0.09 + 0.18 + 0.27 + 0.36 + 0.1 + 0.4 / 6) / 6, abs=1e-6)
    errors = [p for p in s["problems"] if p["level"] == "error"]
    assert errors == [{"level": "error", "actor": "scheduler", "event": "step.failed",
                       "count": 2, "example": "boom"}]
    assert s["problems"][0]["level"] == "error"  # most severe first
    retracted = next(p for p in s["problems"] if p["event"] == "request.retracted")
    assert retracted["count"] == 2 and retracted["actor"] == "scheduler"
    assert [r["rid"] for r in s["slowest"]] == ["s-3", "s-2"]
    assert s["slowest"][0]["e2e_s"] == 4.0 and s["slowest"][0]["ttft_s"] == pytest.approx(0.4)
    runner = s["runner"]
    assert runner["intervals"] == 4 and runner["busy_fraction"] == pytest.approx(0.5)
    assert [r["busy_fraction"] for r in runner["over_time"]] == [0.5] * 4
    assert runner["over_time"][0]["tokens_per_s"] == pytest.approx(20.0)


def test_the_scheduler_end_stands_in_when_the_tokenizer_logged_none():
    lines = [line(0, "request.received", "tokenizer", rid="e-1", prompt_tokens=3),
             line(0.1, "request.ended", rid="e-1", reason="error", prompt_tokens=3,
                  completion_tokens=0, error="model runner failed: x")]
    s = summarize(parse_records(lines))
    assert s["requests"]["by_reason"] == {"error": 1}
    assert s["latency_s"]["ttft"] is None and s["runner"] is None


def test_an_empty_log_summarizes_to_zeros():
    s = summarize([])
    assert s["requests"]["ended"] == 0 and s["tokens"]["completion"] == 0
    assert s["window"]["records"] == 0 and s["slowest"] == []


def test_percentiles_interpolate_like_numpy():
    p = percentiles([4.0, 1.0, 3.0, 2.0, None])
    assert p["count"] == 4 and p["p50"] == 2.5 and p["max"] == 4.0
    assert p["p90"] == pytest.approx(3.7) and p["mean"] == 2.5
    assert percentiles([None]) is None


def test_filters_by_time_actor_level_event_and_rid():
    records = parse_records(one_request("r-1", 0.0) + one_request("q-1", 1.0)
                            + [line(2.0, "step.failed", level="error", error="x")])
    ev = lambda keep: [(r["event"], r.get("rid")) for r in select(records, keep)]  # noqa: E731
    assert ev(Filter(event="step.*")) == [("step.failed", None)]
    assert ev(Filter(level="warning")) == [("step.failed", None)]
    assert {r for _, r in ev(Filter(rid_prefix="q-"))} == {"q-1"}
    assert {a["actor"] for a in select(records, Filter(actors=("tokenizer",)))} == {"tokenizer"}
    window = select(records, Filter(since=T0 + 1.0, until=T0 + 1.5))
    assert {r.get("rid") for r in window} == {"q-1"}
    assert ev(Filter(event="request.*", rid="r-1"))[0] == ("request.received", "r-1")
    assert len(ev(Filter(actors=("runner",)))) == 0


def test_time_bounds_as_people_write_them():
    now, start = T0 + 3600, T0
    assert parse_when("10m", now, start) == now - 600
    assert parse_when("90s", now, start) == now - 90
    assert parse_when("+30s", now, start) == start + 30
    assert parse_when("2025-06-15T12:00:00Z", now, start) == datetime(
        2025, 6, 15, 12, tzinfo=timezone.utc).timestamp()
    clock = datetime.fromtimestamp(start).strftime("%H:%M:%S")
    assert abs(parse_when(clock, now, start) - start) < 1
    for bad in ("soon", "+x", "25:99"):
        with pytest.raises(ValueError):
            parse_when(bad, now, start)


def test_lines_that_are_not_records_are_skipped():
    assert parse_line("Traceback (most recent call last):") is None
    assert parse_line('{"event": "x"}') is None  # no time
    assert parse_line('{"event": "x", "timestamp": "2025-06-01T00:00:00Z"') is None  # cut
    assert parse_line(line(0, "x"))["_t"] == pytest.approx(T0)


# -- the run files -------------------------------------------------------------------------------


def test_the_run_file_is_named_by_start_and_pid_and_log_file_overrides(tmp_path):
    started = datetime(2025, 6, 1, 14, 22, 33).timestamp()
    assert run_file_name(started, 4711) == "20250601-142233-4711.jsonl"
    cfg = LogConfig(dir=str(tmp_path / "logs"))
    assert run_file(cfg, started, 4711) == str(tmp_path / "logs" / "20250601-142233-4711.jsonl")
    assert run_file(LogConfig(dir="", file="x.jsonl"), started, 1) == os.path.abspath("x.jsonl")
    assert run_file(LogConfig(dir=""), started, 1) == ""
    assert LogConfig().dir == "~/.cache/mlx-actor-serve/logs"


def test_only_the_newest_runs_are_kept_and_other_files_are_left_alone(tmp_path):
    names = ["20250101-000000-1.jsonl", "20250101-000000-1.jsonl.1", "20250102-000000-7.jsonl",
             "20250103-000000-3.jsonl", "notes.txt", "20240101-000000-9.json"]
    for name in names:
        (tmp_path / name).write_text("x\n")
    gone = prune_runs(tmp_path, keep=2)
    assert sorted(p.name for p in gone) == ["20250101-000000-1.jsonl",
                                             "20250101-000000-1.jsonl.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "20240101-000000-9.json", "20250102-000000-7.jsonl", "20250103-000000-3.jsonl",
        "notes.txt"]
    assert latest_run(tmp_path).name == "20250103-000000-3.jsonl"


def test_rotation_renames_down_the_chain_and_drops_the_oldest(tmp_path):
    path = tmp_path / "run.jsonl"
    for k in range(4):
        path.write_text(f"{k}\n" * 100)
        assert rotate(path, max_bytes=50, keep=2)
    assert not path.exists()
    assert [p.name for p in backups(path)] == ["run.jsonl.2", "run.jsonl.1"]
    assert (tmp_path / "run.jsonl.1").read_text().startswith("3\n")
    path.write_text("small\n")
    assert not rotate(path, max_bytes=50, keep=2)
    path.write_text("x" * 100)
    assert rotate(path, max_bytes=50, keep=0) and path.read_text() == ""


def _append(path: str, who: int, n: int) -> None:
    AppendFile.CHECK_S = 0.01
    out = AppendFile(path)
    for k in range(n):
        big = "y" * (20_000 if k % 50 == 0 else 100)  # some lines far past PIPE_BUF
        out.write(json.dumps({"who": who, "k": k, "pad": big}))
        if k % 10 == 0:
            time.sleep(0.002)  # about 0.3 s of writing: many rotations happen meanwhile


@pytest.mark.slow  # spawns the writers
def test_processes_appending_while_the_launcher_rotates_lose_and_tear_no_line(tmp_path):
    path = str(tmp_path / "run.jsonl")
    ctx = mp.get_context("spawn")
    writers = [ctx.Process(target=_append, args=(path, w, 1500)) for w in range(3)]
    for p in writers:
        p.start()
    rotations = 0
    while any(p.is_alive() for p in writers):
        rotations += rotate(path, max_bytes=100_000, keep=1000)
        time.sleep(0.01)
    for p in writers:
        p.join()
        assert p.exitcode == 0
    seen = set()
    for f in [*backups(path), Path(path)]:
        if f.exists():
            for text in f.read_text().splitlines():
                rec = json.loads(text)  # never torn or interleaved
                seen.add((rec["who"], rec["k"]))
    assert rotations >= 3
    assert seen == {(w, k) for w in range(3) for k in range(1500)}


def test_a_writer_moves_to_the_new_file_after_a_rotation(tmp_path, monkeypatch):
    monkeypatch.setattr(AppendFile, "CHECK_S", 0.0)
    path = tmp_path / "run.jsonl"
    out = AppendFile(str(path))
    out.write("first")
    rotate(path, max_bytes=1, keep=1)
    out.write("second")
    out.close()
    assert (tmp_path / "run.jsonl.1").read_text() == "first\n"
    assert path.read_text() == "second\n"


def test_reading_takes_the_backups_first_and_following_survives_rotation(tmp_path,
                                                                         monkeypatch):
    monkeypatch.setattr(AppendFile, "CHECK_S", 0.0)
    path = tmp_path / "run.jsonl"
    out = AppendFile(str(path))
    out.write(line(0, "a"))
    rotate(path, 1, keep=3)
    out.write(line(1, "b"))
    assert [r["event"] for r in read_records(path)] == ["a", "b"]
    assert [r["event"] for r in read_records(path, with_backups=False)] == ["b"]

    got: list[str] = []
    done = threading.Event()
    idle = threading.Event()  # follow() asks stop() only once it has read all there is

    def stop() -> bool:
        idle.set()
        return done.is_set()

    def tail():
        for rec in follow(path, stop=stop, poll_s=0.01):
            got.append(rec["event"])

    def until(condition) -> bool:
        deadline = time.monotonic() + 5
        while not condition() and time.monotonic() < deadline:
            time.sleep(0.01)
        return condition()

    reader = threading.Thread(target=tail, daemon=True)
    reader.start()
    try:
        # Open and at the end of the file: following starts there, "b" is not shown.
        assert idle.wait(5)
        out.write(line(2, "c"))
        assert until(lambda: got == ["c"]), got  # read from the file before it is renamed
        rotate(path, 1, keep=3)
        out.write(line(3, "d"))  # to the new file, which the reader takes up from its start
        assert until(lambda: len(got) >= 2), got
    finally:
        done.set()
        reader.join(5)
    assert not reader.is_alive()
    assert got == ["c", "d"]


# -- the command ---------------------------------------------------------------------------------


@pytest.fixture
def log_file(tmp_path) -> Path:
    path = tmp_path / "20250601-000000-1.jsonl"
    lines = (one_request("r-1", 0.0, chunks=2, retracted=1, req_id="client-7")
             + one_request("r-2", 0.2, reason="abort", out=2)
             + [line(0.3, "step.failed", level="error", error="boom")]
             + [line(1.0, "runner.utilisation", "runner", busy_s=0.8, wall_s=1.0, steps=4,
                     tokens_per_s=9.0)])
    path.write_text("\n".join(lines) + "\nnot json\n")
    return path


def test_the_command_prints_a_summary_as_json(log_file, capsys):
    assert cli.main(["logs", str(log_file), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["file"] == str(log_file)
    assert s["requests"]["by_reason"] == {"abort": 1, "stop": 1}
    assert s["tokens"]["completion"] == 7 and s["retractions"]["count"] == 1


def test_the_command_draws_a_summary_and_a_timeline(log_file, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")  # the width of a terminal, whatever runs the test
    assert cli.main(["logs", str(log_file.parent)]) == 0  # a folder: its newest run
    out = capsys.readouterr().out
    for text in ("requests", "abort", "time to first token", "step.failed", "runner busy",
                 "slowest requests", "r-1"):
        assert text in out, text
    assert cli.main(["logs", str(log_file), "--rid", "client-7"]) == 0
    out = capsys.readouterr().out
    events = ("request.received", "request.queued", "request.admitted",
              "request.prefill_chunk", "request.first_token", "request.retracted",
              "request.ended", "request.finished")
    positions = [out.index(e) for e in events]
    assert positions == sorted(positions) and "r-1 (req_id client-7)" in out


def test_the_command_lists_filtered_records_and_refuses_what_it_cannot_read(log_file,
                                                                            capsys):
    assert cli.main(["logs", str(log_file), "--list", "--json", "--event", "request.*",
                     "--rid-prefix", "r-2", "--actor", "tokenizer"]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert [r["event"] for r in recs] == ["request.received", "request.first_token",
                                          "request.finished"]
    assert all("_t" not in r for r in recs)
    assert cli.main(["logs", str(log_file), "--list", "--level", "error"]) == 0
    assert "step.failed" in capsys.readouterr().out
    assert cli.main(["logs", str(log_file), "--rid", "nope"]) == 1
    assert cli.main(["logs", str(log_file.parent / "missing.jsonl")]) == 2
    assert cli.main(["logs", str(log_file), "--since", "whenever"]) == 2
    assert cli.main(["logs", str(log_file), "--rid", "r-2", "--json"]) == 0
    timelines = json.loads(capsys.readouterr().out)
    assert [t["rid"] for t in timelines] == ["r-2"]
    assert timelines[0]["steps"][-1]["event"] == "request.finished"
    assert timelines[0]["steps"][-1]["reason"] == "abort"
