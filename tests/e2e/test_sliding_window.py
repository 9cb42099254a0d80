"""A sliding-window model (the gemma3-tiny built-in: layers 0 and 2 keep the last 32 positions
in a RotatingKVCache, layers 1 and 3 full attention) through the real graph with the default
config, prefix cache on: a radix node restores the full layers from KV slots and the sliding
layers from a window snapshot in a state slot. Every reply is mlx-lm's greedy output, batched,
past the window, repeated (with hits), and as n choices of one prompt."""

from __future__ import annotations

import asyncio

import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient
from harness.oracle import Oracle

pytestmark = pytest.mark.slow

TEXT = ("Rivers carry silt from the mountains to the sea, and the deltas they build shift with "
        "every flood. ") * 12


def _prompts(oracle: Oracle) -> list[list[int]]:
    ids = oracle.tokenizer.encode(TEXT)
    assert len(ids) >= 240
    return [ids[:12], ids[:80], ids[7:130], ids[30:230], ids[3:36]]


async def _batch(address: str, prompts: list[list[int]], n: int, group: str = ""):
    async with AsyncClient(address) as client:
        return await asyncio.gather(*[client.generate(p, max_new_tokens=n, group=group)
                                      for p in prompts])


def _run(address: str, oracle: Oracle) -> list[tuple[list[int], object, int]]:
    """(prompt, reply, max_new) for every request sent."""
    prompts = _prompts(oracle)
    sent = []

    def batch(ps, n, group=""):
        replies = asyncio.run(asyncio.wait_for(_batch(address, ps, n, group), 180))
        sent.extend((p, r, n) for p, r in zip(ps, replies))

    batch(prompts, 40)  # one batch, prompts up to six windows long
    batch(prompts[1:4], 32)  # the same prompts again: prefix hits on a full-attention model
    batch(prompts[1:4] + prompts[:1], 24)
    batch([prompts[2]] * 3, 24, group="n3")  # n = 3 choices of one prompt
    return sent


def test_sliding_window_model_with_the_default_config_matches_mlx_lm(model_cache):
    path = ensure_builtin("gemma3-tiny", cache_dir=model_cache, progress=False)
    g = Graph("model.builtin=gemma3-tiny")
    try:
        oracle = Oracle(str(path))
        sent = _run(g.address, oracle)
    finally:
        assert g.stop() == 0
    refs: dict[tuple, list[int]] = {}
    for prompt, reply, n in sent:
        key = (tuple(prompt), n)
        if key not in refs:
            refs[key] = oracle.greedy(prompt, n)
        assert reply.finish_reason == "length"
        oracle.check(prompt, reply.token_ids, refs[key])
    # The second batch repeats prompts of the first, up to six windows long: all hit.
    again = sent[len(_prompts(oracle)):][:3]
    assert all(reply.cached_tokens > 0 for _, reply, _ in again), again
    assert max(reply.cached_tokens for _, reply, _ in again) > 2 * 32

    assert g.events("runner.layers")[0]["kinds"] == ["sliding", "full", "sliding", "full"]
    assert g.events("cache.prefix_off") == []
    config = g.events("scheduler.config")[0]
    assert config["prefix_cache"] is True and config["share_groups"] is True
    assert config["state_slots"] > 0  # the windows' snapshots
    assert g.events("step.failed") == [] and g.events("step.error") == []
    assert g.events("scheduler.leak") == [] and g.events("cache.hit") != []
