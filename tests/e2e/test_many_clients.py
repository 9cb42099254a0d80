"""64 clients at once on the default config: max_running_requests is "auto" (launch/sizing.py),
so they decode together in batches far larger than the old fixed 16, each request's greedy
tokens still mlx_lm.generate's."""

from __future__ import annotations

import asyncio
import importlib.util
import re
import urllib.request

import numpy as np
import pytest

from harness.graph import Graph
from protocol.client import AsyncClient
from models.builtin import ensure_builtin
from harness.oracle import Oracle

pytestmark = pytest.mark.slow

CLIENTS = 64


@pytest.fixture(scope="module")
def oracle(model_cache):
    return Oracle(str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)))


def _requests() -> list[tuple[list[int], int]]:
    """Prompts of 1 to ~300 ordinary tokens and 4 to 40 new tokens, all different."""
    rng = np.random.default_rng(64)
    return [(rng.integers(1000, 100_000, size=1 + (37 * k) % 301).tolist(), 4 + (k * 7) % 37)
            for k in range(CLIENTS)]


async def _all_at_once(address: str, requests) -> list:
    clients = [AsyncClient(address) for _ in range(8)]
    try:
        return await asyncio.wait_for(asyncio.gather(*[
            clients[k % len(clients)].generate(ids, max_new_tokens=n)
            for k, (ids, n) in enumerate(requests)]), 300)
    finally:
        for c in clients:
            await c.close()


@pytest.fixture(scope="module")
def expected(oracle) -> list[list[int]]:
    """mlx-lm's greedy tokens for _requests(), computed once for both graphs below."""
    return [oracle.greedy(ids, n) for ids, n in _requests()]


def _served_equal_mlx_lm(address: str, oracle, expected) -> list:
    """_requests() sent at once; every reply's tokens checked against mlx-lm's."""
    requests = _requests()
    got = asyncio.run(_all_at_once(address, requests))
    for (ids, _), reply, ref in zip(requests, got, expected):
        assert reply.prompt_tokens == len(ids)
        oracle.check(ids, reply.token_ids, ref)
    return got


def test_64_concurrent_requests_of_different_lengths_equal_mlx_lm(graph, oracle, expected):
    got = _served_equal_mlx_lm(graph.address, oracle, expected)
    assert len({tuple(r.token_ids) for r in got}) > CLIENTS // 2  # varied continuations
    # The batch was sized for them (auto): many rows ran at once
    # (short requests end before the last prompts are in, so their rows are reused).
    sized = graph.events("launch.sizing")[0]
    assert sized["why"].startswith("auto:") and sized["max_running_requests"] >= 8
    rows = {r["row"] for r in graph.events("request.admitted")}
    assert len(rows) >= min(CLIENTS, sized["max_running_requests"]) // 2


def test_prefill_first_holds_the_decoders_for_the_burst_and_keeps_every_token(oracle,
                                                                               expected):
    """scheduler.prefill_first: the same 64 requests at once through real processes; while
    more wait than decode, steps only prefill (step.hold_decode), and every request's tokens
    are still mlx-lm's."""
    g = Graph("model.builtin=qwen3-tiny", "scheduler.prefill_first=true", "log.level=debug")
    try:
        _served_equal_mlx_lm(g.address, oracle, expected)
        assert g.events("step.hold_decode")
    finally:
        assert g.stop() == 0


def test_the_ready_line_runner_log_and_metrics_say_how_many_run_and_why(graph):
    sized = graph.events("launch.sizing")[0]
    value = sized["max_running_requests"]
    ready = graph.wait_for("runner.ready")[0]
    assert ready["max_running_requests"] == value and ready["why"] == sized["why"]
    # The dense built-in decodes compiled wherever the kernels are built (compiled_decode.py).
    assert ready["compiled_decode"] == (importlib.util.find_spec("mas_kernels") is not None)
    assert re.search(r"KV pool holds \d+ requests of 2048 tokens", sized["why"])
    # The ready line gives the KV pool, as runner.ready does.
    pool = re.search(r"; kv pool (\d+) pages of 16 tokens \((\d+) MiB\), workspace (\d+) MiB$",
                     graph.started.line)
    assert pool, graph.started.line
    assert int(pool[1]) == ready["kv_pages"] > 0 and int(pool[3]) == ready["workspace_mib"]
    rates = sized["decode_tok_s_by_rows"]
    assert rates and all(r > 0 for r in rates.values())
    text = urllib.request.urlopen(f"{graph.http}/metrics", timeout=10).read().decode()
    line = next(x for x in text.splitlines() if x.startswith("mas:max_running_requests{"))
    assert line.endswith(f" {value}") and 'why="auto: ' in line
