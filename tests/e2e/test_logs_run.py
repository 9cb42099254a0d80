"""`launch logs` on the log file of a real run: prompts split in chunks, a KV budget small
enough to force retraction, and a request the client aborts. The file is the one the run named
(log.dir), read back through the real CLI entry."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from harness.graph import ROOT, Graph
from models.builtin import ensure_builtin
from models.tokenizer import load_tokenizer
from protocol.client import AsyncClient
from tests.support.streams import abort_a_stream
from tests.support.prompts import tight_budget

pytestmark = pytest.mark.slow

MAX_NEW = 24
CHUNK = 32
# Six distinct prompts of about 150 tokens: five chunks each.
PROMPTS = [" ".join(f"Line {i}: the quick brown fox jumps over the lazy dog."
                    for i in range(k * 10, k * 10 + 10)) for k in range(6)]


async def _run(address: str):
    """Half the prompts, a stream, then the other half once something decodes (the KV budget
    fits the first wave, not its growth: retraction); then one long request, aborted."""
    half = len(PROMPTS) // 2
    async with AsyncClient(address) as client:
        first = [asyncio.ensure_future(client.generate(p, max_new_tokens=MAX_NEW))
                 for p in PROMPTS[:half]]
        stream = await client.generate(PROMPTS[0], max_new_tokens=MAX_NEW, stream=True)
        await stream.__anext__()
        later = [asyncio.ensure_future(client.generate(p, max_new_tokens=MAX_NEW))
                 for p in PROMPTS[half:]]
        streamed = [piece async for piece in stream][-1]
        done = [*await asyncio.gather(*first, *later), streamed]
        return done, await abort_a_stream(client)


def _logs(*args: str) -> str:
    out = subprocess.run([sys.executable, "-m", "launch", "logs", *args], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_run_reads_back_as_timelines_and_a_summary(model_cache, tmp_path):
    path = ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    ids = [load_tokenizer(str(path)).encode(p) for p in PROMPTS]
    tight = tight_budget(ids, MAX_NEW)
    log_dir = tmp_path / "logs"
    g = Graph("model.builtin=qwen3-tiny", "scheduler.max_running_requests=6",
              f"scheduler.chunked_prefill_size={CHUNK}", "scheduler.output_reserve_tokens=0",
              "cache.prefix=false", f"memory.kv_tokens={tight}", f"log.dir={log_dir}",
              "log.stats_interval_s=0.5")
    try:
        done, aborted = asyncio.run(asyncio.wait_for(_run(g.address), 180))
    finally:
        assert g.stop() == 0
    files = list(log_dir.glob("*.jsonl"))
    assert len(files) == 1 and g.events("launch.ready")[0]["log_file"] == str(files[0])
    log = str(files[0])
    assert aborted.finish_reason == "abort"
    retracted = {r["rid"] for r in g.events("request.retracted")}
    assert retracted, "the KV budget was meant to force retraction"

    summary = json.loads(_logs(log, "--json"))
    reasons = summary["requests"]["by_reason"]
    assert sum(reasons.values()) == len(done) + 1 and reasons["abort"] == 1
    assert summary["requests"]["open"] == 0
    assert summary["tokens"]["completion"] == (sum(r.completion_tokens for r in done)
                                               + aborted.completion_tokens)
    assert summary["tokens"]["prompt"] == sum(r.prompt_tokens for r in done) + \
        aborted.prompt_tokens
    assert summary["retractions"]["requests"] == len(retracted)
    assert summary["requests"]["chunked"] >= len(PROMPTS)
    assert summary["latency_s"]["ttft"]["count"] == len(done) + 1
    assert len(summary["slowest"]) == 5
    assert summary["runner"]["intervals"] >= 1
    assert 0 < summary["runner"]["busy_fraction_while_reporting"] <= 1

    # A retracted request: received, queued, admitted, its prompt in chunks, its first token,
    # retracted, admitted again (prompt and output so far, in chunks), ended, finished.
    rid = sorted(retracted)[0]
    [life] = json.loads(_logs(log, "--rid", rid, "--json"))
    events = [s["event"] for s in life["steps"]]
    assert events[:3] == ["request.received", "request.queued", "request.admitted"]
    assert events[-2:] == ["request.ended", "request.finished"]
    first = events.index("request.first_token")
    chunks = [s for s in life["steps"][:first] if s["event"] == "request.prefill_chunk"]
    assert len(chunks) >= 2 and all(c["tokens"] <= CHUNK for c in chunks)
    assert sum(c["tokens"] for c in chunks) == life["steps"][0]["prompt_tokens"]
    assert events.count("request.admitted") == events.count("request.retracted") + 1
    for k, event in enumerate(events):
        if event == "request.retracted":
            assert "request.admitted" in events[k:]
    assert first < events.index("request.retracted")
    starts = [s["since_start_s"] for s in life["steps"]]
    assert starts == sorted(starts) and all(s["gap_s"] >= 0 for s in life["steps"])

    # The aborted one, by its client's req_id.
    [life] = json.loads(_logs(log, "--rid", "victim", "--json"))
    events = [s["event"] for s in life["steps"]]
    assert events[0] == "request.received" and events[-1] == "request.finished"
    for before, after in [("request.admitted", "request.first_token"),
                          ("request.first_token", "request.client_abort"),
                          ("request.client_abort", "request.abort"),
                          ("request.abort", "request.ended")]:
        assert events.index(before) < events.index(after), (before, after, events)
    assert life["steps"][-1]["reason"] == "abort"

    drawn = _logs(log, "--rid", rid)
    positions = [drawn.index(e) for e in ("request.received", "request.prefill_chunk",
                                          "request.first_token", "request.retracted",
                                          "request.finished")]
    assert positions == sorted(positions)
    table = _logs(log)
    assert "slowest requests" in table and "abort" in table
