"""scheduler.dp = 2: two scheduler + runner pairs behind one tokenizer and detokenizer.

Concurrent requests spread over both replicas (the logs' `replica` field), greedy tokens equal
mlx-lm's (as with one replica), a repeated long prefix goes to the replica that cached it, and
/metrics counts each replica."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient
from harness.oracle import Oracle

pytestmark = pytest.mark.slow

PROMPTS = [f"Request number {i}: tell me about {topic}." for i, topic in enumerate(
    ["rivers", "mountains", "the sea", "deserts", "forests", "cities"])]
SHARED = "A long shared context that both requests start with, word for word. " * 10
NEW = 10


def _message(http: str, text: str, session: str) -> dict:
    """One /v1/messages request with Claude Code's session header."""
    body = json.dumps({"model": "any", "max_tokens": 2, "temperature": 0,
                       "messages": [{"role": "user", "content": text}]}).encode()
    req = urllib.request.Request(f"{http}/v1/messages", body, {
        "content-type": "application/json", "x-claude-code-session-id": session})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


async def _run(address: str):
    async with AsyncClient(address) as client:
        together = await asyncio.gather(*[client.generate(p, max_new_tokens=NEW)
                                          for p in PROMPTS])
        first = await client.generate(SHARED + "Question one?", max_new_tokens=NEW)
        # Keep the first one's replica busy-ish: the router must still pick it for the prefix.
        second = await client.generate(SHARED + "Question two?", max_new_tokens=NEW)
    return together, first, second


def test_dp2_spreads_requests_keeps_tokens_and_routes_prefixes(model_cache):
    path = str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False))
    g = Graph(f"model.path={path}", "scheduler.dp=2")
    try:
        together, first, second = asyncio.run(asyncio.wait_for(_run(g.address), 180))
        # An agent's session: two turns of nothing in common but Claude Code's session header.
        turns = [_message(g.started.http, text, "session-a") for text in ("Hi.", "Bye now.")]
        with urllib.request.urlopen(f"{g.started.http}/metrics", timeout=30) as r:
            metrics = r.read().decode()
    finally:
        assert g.stop() == 0
    oracle = Oracle(path)
    for prompt, reply in zip(PROMPTS, together):
        ids = oracle.tokenizer.encode(prompt)
        oracle.check(ids, reply.token_ids, oracle.greedy(ids, NEW))
    for text, reply in (("Question one?", first), ("Question two?", second)):
        ids = oracle.tokenizer.encode(SHARED + text)
        oracle.check(ids, reply.token_ids, oracle.greedy(ids, NEW))

    # Two runner processes on one machine already split its cores: neither pins (cores.py).
    pinned = [r for r in g.records if r.get("event") == "runner.cores"]
    assert len(pinned) == 2 and not any(r["pinned"] for r in pinned)
    received = {r["rid"]: r for r in g.records if r.get("event") == "request.received"}
    assert {r["replica"] for r in received.values()} == {0, 1}  # spread over both
    # Every scheduler record says its replica, and each request ran where it was routed.
    ended = [r for r in g.records if r.get("event") == "request.ended"]
    assert ended and all(r["replica"] == received[r["rid"]]["replica"] for r in ended)
    assert {r["actor"] for r in g.records if r.get("replica") == 1} == {
        "tokenizer", "scheduler.1", "runner.1"}  # the tokenizer on its routed requests
    by_order = sorted(received.values(), key=lambda r: int(r["rid"].rsplit("-", 1)[1]))
    shared_first, shared_second, one, two = by_order[-4:]  # then the session's two turns
    assert shared_second["routed_by"] == "prefix"
    assert shared_second["replica"] == shared_first["replica"]
    assert first.cached_tokens == 0 and second.cached_tokens > 0
    counted = {line.split('replica="')[1].split('"')[0]: int(line.rsplit(" ", 1)[1])
               for line in metrics.splitlines()
               if line.startswith("mas:replica_requests_total{")}
    assert counted.keys() == {"0", "1"} and sum(counted.values()) == len(received)
    # The session's second turn went where its first did, named as the reason.
    assert all(t["stop_reason"] == "max_tokens" for t in turns)
    assert two["routed_by"] == "session" and two["replica"] == one["replica"]
