"""runner.tp = 2 on this machine: two ranks of one mlx.distributed ring over loopback.

Greedy tokens equal mlx-lm's (the same oracle TP = 1 is held to) alone and concurrent, overlap
on and off, prefix hit and miss, dense and hybrid; a rank that dies or stalls stops the graph
with an error reply to every open request; a model class mlx-lm cannot shard is refused at
launch by name."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time

import pytest

from harness.graph import Graph, alive, start_graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient, ServerError
from harness.oracle import Oracle

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world", "中文的自然语言处理很有趣", "🎉 emoji and code: x = [1, 2, 3]",
           "A longer prompt about many things. " * 30]
SHARED = "The same long system prompt, sent twice so the second finds it cached. " * 12
NEW = 12


@functools.cache
def oracle(path: str) -> Oracle:
    return Oracle(path)


async def _run(address: str):
    async with AsyncClient(address) as client:
        alone = [await client.generate(p, max_new_tokens=NEW) for p in PROMPTS]
        together = await asyncio.gather(*[client.generate(p, max_new_tokens=NEW)
                                          for p in PROMPTS])
        first = await client.generate(SHARED + "First.", max_new_tokens=NEW)
        second = await client.generate(SHARED + "Second.", max_new_tokens=NEW)
    return alone, together, first, second


# `make test`: dense without overlap, hybrid with it; the other two are the extended matrix.
@pytest.mark.parametrize("builtin,overlap", [
    ("qwen3-tiny", "false"), ("qwen3_5-tiny", "true"),
    pytest.param("qwen3-tiny", "true", marks=pytest.mark.matrix),
    pytest.param("qwen3_5-tiny", "false", marks=pytest.mark.matrix)])
def test_tp2_greedy_equals_mlx_lm(model_cache, builtin, overlap):
    path = str(ensure_builtin(builtin, cache_dir=model_cache, progress=False))
    g = Graph(f"model.path={path}", "runner.tp=2", f"scheduler.overlap={overlap}")
    try:
        alone, together, first, second = asyncio.run(asyncio.wait_for(_run(g.address), 240))
    finally:
        assert g.stop() == 0
    ranks = {r.get("rank") for r in g.records if r.get("event") == "runner.rank"}
    assert ranks == {0, 1}
    assert {r["actor"] for r in g.records if r.get("event") == "actor.ready"} >= {
        "runner", "runner-1"}
    ref = oracle(path)
    for prompt, a, b in zip(PROMPTS, alone, together):
        ids = ref.tokenizer.encode(prompt)
        want = ref.greedy(ids, NEW)
        ref.check(ids, a.token_ids, want)
        ref.check(ids, b.token_ids, want)
    for text, reply in (("First.", first), ("Second.", second)):
        ids = ref.tokenizer.encode(SHARED + text)
        ref.check(ids, reply.token_ids, ref.greedy(ids, NEW))
    assert first.cached_tokens == 0 and second.cached_tokens > 0  # miss, then hit


async def _stream_until(address: str, n: int, ready: asyncio.Event, got: list[int], i: int):
    async with AsyncClient(address) as client:
        try:
            async for _ in await client.generate(f"count {i}", max_new_tokens=4000,
                                                 ignore_eos=True, stream=True):
                got[i] += 1
                if min(got) >= n:
                    ready.set()
        except ServerError as e:
            return str(e), time.monotonic()
    return "finished", time.monotonic()


async def _kill_mid_stream(address: str, pid: int, sig: int, streams: int = 3):
    got, ready = [0] * streams, asyncio.Event()
    tasks = [asyncio.ensure_future(_stream_until(address, 3, ready, got, i))
             for i in range(streams)]
    await asyncio.wait_for(ready.wait(), 120)
    at = time.monotonic()
    os.kill(pid, sig)
    return [(text, when - at) for text, when in await asyncio.gather(*tasks)]


def _pids(g: Graph) -> dict[str, int]:
    return {r["name"]: r["child_pid"] for r in g.records if r.get("event") == "actor.spawned"}


@pytest.mark.parametrize("victim", ["runner-1", pytest.param("runner", marks=pytest.mark.matrix)])
def test_a_dead_rank_errors_every_open_request_and_stops_the_graph(model_cache, victim):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    g = Graph("model.builtin=qwen3-tiny", "runner.tp=2")
    pids = _pids(g)
    try:
        ends = asyncio.run(asyncio.wait_for(
            _kill_mid_stream(g.address, pids[victim], signal.SIGKILL), 180))
        for text, after in ends:  # the launcher's "actor ... died", or the peer-lost step's
            assert text != "finished" and after < 1.0, (text, after)
        assert g.started.proc.wait(30) != 0
        assert not [name for name, pid in pids.items() if alive(pid)]
    finally:
        g.stop()


def test_a_stalled_rank_is_an_actor_death(model_cache):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    # The stopped rank cannot act on SIGTERM: the launcher kills it after stop_timeout_s.
    g = Graph("model.builtin=qwen3-tiny", "runner.tp=2", "runner.step_timeout_s=2",
              "launch.stop_timeout_s=1")
    pids = _pids(g)
    try:
        ends = asyncio.run(asyncio.wait_for(
            _kill_mid_stream(g.address, pids["runner-1"], signal.SIGSTOP), 180))
        for text, after in ends:
            assert "died" in text and after < 2.0 + 3.0, (text, after)
        assert g.started.proc.wait(30) != 0
        assert not [name for name, pid in pids.items() if alive(pid)]
    finally:
        g.stop()
    stalled = [r for r in g.records if r.get("event") == "runner.stalled"]
    assert stalled and stalled[0]["actor"] == "runner" and stalled[0]["seconds"] >= 2


def test_a_model_without_shard_is_refused_by_class(model_cache):
    ensure_builtin("gemma3-tiny", cache_dir=model_cache, progress=False)
    lines: list[str] = []
    with pytest.raises(RuntimeError, match="did not start"):
        start_graph("model.builtin=gemma3-tiny", "runner.tp=2", on_log=lines.append,
                    ready_timeout=120)
    text = "\n".join(lines)
    assert "mlx_lm.models.gemma3_text.Model has no shard()" in text, text[-3000:]


def test_a_rank_on_another_host_started_by_launch_only(model_cache):
    """The layout of two machines on this one: rank 1 listens on 127.0.0.2 (another host as
    far as the config knows), the main launcher leaves it out, `launch --only runner-1`
    starts it there, and the graph's shutdown stops it."""
    import socket
    import subprocess
    import sys

    from harness.graph import ROOT

    path = str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sets = [f"model.path={path}", "runner.tp=2", 'runner.hosts=["127.0.0.1", "127.0.0.2"]',
            f"runner.port={port}"]
    args = [sys.executable, "-m", "launch", "--config", str(ROOT / "configs" / "qwen.toml"),
            "--only", "runner-1", "--set", "log.stderr=false",
            *[a for o in sets for a in ("--set", o)]]
    there = subprocess.Popen(args, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        g = Graph(*sets)
        assert there.stdout.readline().strip() == "mlx-actor-serve part ready: runner-1"
        try:
            replies = asyncio.run(asyncio.wait_for(_run(g.address), 240))
        finally:
            assert g.stop() == 0
        assert there.wait(30) == 0  # rank 0 passed the shutdown on
    finally:
        if there.poll() is None:
            there.kill()
    spawned = {r["name"] for r in g.records if r.get("event") == "actor.spawned"}
    assert "runner-1" not in spawned and "runner" in spawned
    ref = oracle(path)
    for prompt, reply in zip(PROMPTS, replies[0]):
        ids = ref.tokenizer.encode(prompt)
        ref.check(ids, reply.token_ids, ref.greedy(ids, NEW))
