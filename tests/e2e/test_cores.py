"""The runner's stream thread on a core of its own and every other thread of the graph on the
others (actors/model_runner/cpu/cores.py), as /proc shows them in a real graph."""

from __future__ import annotations

import importlib.util
import os

import pytest

from harness.procs import children, title

pytestmark = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
    or importlib.util.find_spec("mas_kernels") is None,
    reason="needs Linux, 2+ CPUs and the compiled kernels")


def _cpus(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)  # a thread id names the thread, whichever its process


def test_the_stream_thread_has_a_core_of_its_own_and_the_graph_the_others(graph):
    import mlx.core as mx

    if mx.default_device() != mx.cpu:
        pytest.skip("pinned where MLX runs on the CPU")
    logged = graph.wait_for("runner.cores")[0]
    assert logged["pinned"] is True, logged
    stream, others = logged["stream_core"], set(logged["other_cores"])
    assert stream not in others and others
    assert logged["actors"] == 4  # the launcher and the tokenizer, scheduler, detokenizer
    runner = graph.actor_pids()["runner"]
    assert _cpus(logged["stream_thread"]) == {stream}
    # The launcher and its actors (multiprocessing's idle resource tracker, a child too, is
    # not one of the graph's named processes and is left where it is).
    pids = [p for p in [graph.proc.pid, *children(graph.proc.pid)] if title(p).startswith("mas-")]
    assert runner in pids and len(pids) == 5
    for pid in pids:
        for tid in map(int, os.listdir(f"/proc/{pid}/task")):
            if tid == logged["stream_thread"]:
                continue
            assert _cpus(tid) <= others, (pid, tid)
    # It still serves, its tokens those of the unpinned graph (the oracle tests check values).
    import asyncio

    from protocol.client import AsyncClient

    async def ask() -> list[int]:
        client = AsyncClient(graph.address)
        try:
            reply = await client.generate([9707, 1879], max_new_tokens=4, ignore_eos=True)
            return reply.token_ids
        finally:
            await client.close()

    assert len(asyncio.run(asyncio.wait_for(ask(), 60))) == 4
