"""Scheduling modes through the real graph: overlap on and off, prompts split into chunks that
run beside decodes, a KV budget small enough to force retraction, and requests arriving while
others decode. Greedy token ids must equal mlx_lm.generate in every mode."""

from __future__ import annotations

import asyncio

import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol import messages as m
from protocol.client import AsyncClient
from harness.oracle import Oracle
from tests.support.prompts import PROMPTS, tight_budget

pytestmark = pytest.mark.slow

MAX_NEW = 24
# Six distinct prompts of about 150 tokens for the tight-memory mode.
MEDIUM = [" ".join(f"Line {i}: the quick brown fox jumps over the lazy dog."
                   for i in range(k * 10, k * 10 + 10)) for k in range(6)]
MODES = {
    "plain": (["scheduler.overlap=false"], PROMPTS),
    "overlap": (["scheduler.overlap=true"], PROMPTS),
    "overlap-chunked-tight": (["scheduler.overlap=true", "scheduler.chunked_prefill_size=32",
                               "scheduler.output_reserve_tokens=0", "log.level=debug",
                               "cache.prefix=false"], MEDIUM),
}


@pytest.fixture(scope="module")
def oracle(model_cache):
    return Oracle(str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)))


async def _waves(address: str, prompts: list[str]) -> list[m.Finished]:
    """Half the prompts first; the other half once the first ones are decoding."""
    half = len(prompts) // 2
    async with AsyncClient(address) as client:
        first = [asyncio.ensure_future(client.generate(p, max_new_tokens=MAX_NEW))
                 for p in prompts[:half]]
        stream = await client.generate(prompts[0], max_new_tokens=MAX_NEW, stream=True)
        await stream.__anext__()  # something is decoding now
        later = [asyncio.ensure_future(client.generate(p, max_new_tokens=MAX_NEW))
                 for p in prompts[half:]]
        async for _ in stream:
            pass
        return list(await asyncio.gather(*first, *later))


@pytest.mark.parametrize("mode", sorted(MODES))
def test_every_mode_matches_mlx_lm(model_cache, oracle, mode):
    overrides, prompts = MODES[mode]
    ids = [oracle.tokenizer.encode(p) for p in prompts]
    tight = tight_budget(ids, MAX_NEW)
    if "tight" in mode:
        overrides = [*overrides, f"memory.kv_tokens={tight}"]
    g = Graph("model.builtin=qwen3-tiny", "scheduler.max_running_requests=6", *overrides)
    try:
        replies = asyncio.run(asyncio.wait_for(_waves(g.address, prompts), 180))
    finally:
        assert g.stop() == 0
    for prompt_ids, reply in zip(ids, replies):
        oracle.check(prompt_ids, reply.token_ids, oracle.greedy(prompt_ids, MAX_NEW))
    assert g.events("scheduler.leak") == []
    assert g.events("scheduler.idle"), "the scheduler never reported an idle check"
    config = g.events("scheduler.config")[0]
    assert config["overlap"] == (mode != "plain")
    if "tight" in mode:
        assert config["kv_slots"] == tight
        assert g.events("request.retracted"), "the KV budget was meant to force retraction"
        chunks = g.events("request.prefill_chunk")
        assert chunks and all(c["tokens"] <= 32 for c in chunks)
