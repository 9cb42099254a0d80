"""Sampling in the continuous batch: seeds reproducible whatever the batch, greedy rows
untouched by sampled neighbours, logprobs on the ZMQ and HTTP APIs."""

from __future__ import annotations

import asyncio
import math
import uuid

import openai
import pytest

from models.builtin import ensure_builtin
from protocol.client import AsyncClient
from harness.oracle import Oracle

pytestmark = pytest.mark.slow


NOISE_TOKENS = 48  # the noise outlasts the 16 tokens of the requests that join it


async def _seeded_alone_then_busy(address: str, tag: str):
    seeded = dict(max_new_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    async with AsyncClient(address) as c:
        alone = await c.generate("A seeded story:", **seeded)
        greedy_alone = await c.generate("The capital of France is", max_new_tokens=16)
        noise = [await c.generate(f"Noise {k}", max_new_tokens=NOISE_TOKENS, temperature=1.2,
                                  top_k=40, ignore_eos=True, stream=True,
                                  req_id=f"{tag}-noise-{k}") for k in range(4)]
        for stream in noise:
            await anext(stream)  # running: the seeded one joins a busy batch, at a later step
        busy, greedy_busy = await asyncio.gather(
            c.generate("A seeded story:", **seeded, req_id=f"{tag}-seeded"),
            c.generate("The capital of France is", max_new_tokens=16, req_id=f"{tag}-greedy"))
        other_seed = await c.generate("A seeded story:", **{**seeded, "seed": 99})
        for stream in noise:
            async for _ in stream:
                pass
    return alone, busy, other_seed, greedy_alone, greedy_busy


def _rid(graph, req_id: str) -> str:
    found = graph.wait_for("request.received", timeout=20, req_id=req_id)
    assert found, f"no request.received for {req_id}"
    return found[0]["rid"]


def _batched_with(graph, rid: str, others: list[str]) -> list[str]:
    """The requests among `others` that were rows of the last step `rid` sampled in, as the
    scheduler's own records prove it. Every running request is a row of every step that
    decodes (actors/scheduler/core.py, _decode_rows), so one admitted before `rid` and ended
    after it, never retracted, was in the step that gave `rid` its last token (a decoding
    step: none held). The scheduler writes these records in the order it acts, and they reach
    graph.records in that order (one process, one pipe)."""
    for r in (rid, *others):
        assert graph.wait_for("request.ended", timeout=20, rid=r), f"{r} never ended"
    at = {(rec["event"], rec["rid"]): k for k, rec in enumerate(graph.records)
          if rec.get("event") in ("request.admitted", "request.ended")}
    retracted = {rec["rid"] for rec in graph.events("request.retracted")}
    assert rid not in retracted
    return [o for o in others if o not in retracted
            and at["request.admitted", o] < at["request.admitted", rid]
            and at["request.ended", o] > at["request.ended", rid]]


def test_seeded_and_greedy_requests_ignore_their_neighbours(graph, model_cache):
    tag = uuid.uuid4().hex[:8]
    alone, busy, other, greedy_alone, greedy_busy = asyncio.run(
        asyncio.wait_for(_seeded_alone_then_busy(graph.address, tag), 120))
    # The second sends shared steps with the sampled noise: what the checks below compare.
    noise = [_rid(graph, f"{tag}-noise-{k}") for k in range(4)]
    for req_id in (f"{tag}-seeded", f"{tag}-greedy"):
        assert _batched_with(graph, _rid(graph, req_id), noise), f"{req_id} ran alone"
    assert busy.token_ids == alone.token_ids
    assert other.token_ids != alone.token_ids
    assert greedy_busy.token_ids == greedy_alone.token_ids
    oracle = Oracle(str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)))
    ids = oracle.tokenizer.encode("The capital of France is")
    oracle.check(ids, greedy_busy.token_ids, oracle.greedy(ids, 16))


async def _logprobs(address: str):
    async with AsyncClient(address) as c:
        whole = await c.generate("Hello world", max_new_tokens=6, logprobs=True, top_logprobs=3)
        stream = await c.generate("Hello world", max_new_tokens=6, logprobs=True,
                                  top_logprobs=3, stream=True)
        pieces = [p async for p in stream]
    return whole, pieces[-1]


def test_logprobs_on_zmq_greedy_chosen_is_the_best(graph):
    whole, streamed = asyncio.run(asyncio.wait_for(_logprobs(graph.address), 60))
    for r in (whole, streamed):
        assert len(r.logprobs) == len(r.token_ids) == 6
        assert all(len(t) == 3 for t in r.top_ids) and all(len(t) == 3 for t in r.top_logprobs)
        for tok, lp, ids, lps in zip(r.token_ids, r.logprobs, r.top_ids, r.top_logprobs):
            assert ids[0] == tok and math.isclose(lps[0], lp, abs_tol=1e-5) and lp <= 0
            assert lps == sorted(lps, reverse=True)
    assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-5)


def test_logprobs_on_http(graph):
    api = openai.OpenAI(base_url=graph.http + "/v1", api_key="x", max_retries=0)
    r = api.chat.completions.create(model="qwen3-tiny", messages=[{"role": "user", "content": "Hi"}],
                                    max_tokens=5, temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob)
               for t in content)
    c = api.completions.create(model="qwen3-tiny", prompt="Hello", max_tokens=4, temperature=0,
                               logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 4 and all(len(t) <= 2 for t in lp.top_logprobs)


def test_streamed_http_logprobs_equal_the_whole_reply(graph):
    api = openai.OpenAI(base_url=graph.http + "/v1", api_key="x", max_retries=0)
    chat = dict(model="qwen3-tiny", messages=[{"role": "user", "content": "Tell me a story"}],
                max_tokens=8, temperature=0, logprobs=True, top_logprobs=3)
    whole = api.chat.completions.create(**chat).choices[0].logprobs.content
    pieces = [t for chunk in api.chat.completions.create(**chat, stream=True)
              if chunk.choices and chunk.choices[0].logprobs
              for t in chunk.choices[0].logprobs.content]
    assert [t.token for t in pieces] == [t.token for t in whole] and len(whole) == 8
    for got, want in zip(pieces, whole):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-5)
        assert [a.token for a in got.top_logprobs] == [a.token for a in want.top_logprobs]
    text = dict(model="qwen3-tiny", prompt="Once upon a time", max_tokens=6, temperature=0,
                logprobs=2)
    whole = api.completions.create(**text).choices[0].logprobs
    streamed = [c.choices[0].logprobs for c in api.completions.create(**text, stream=True)
                if c.choices and c.choices[0].logprobs]
    assert [t for lp in streamed for t in lp.tokens] == whole.tokens
    assert [x for lp in streamed for x in lp.token_logprobs] == pytest.approx(
        whole.token_logprobs, abs=1e-5)
    assert [t for lp in streamed for t in lp.top_logprobs] == [
        pytest.approx(t, abs=1e-5) for t in whole.top_logprobs]


def test_a_zmq_client_closed_mid_stream_frees_its_row(graph):
    from protocol.client import Client

    idle_before = len(graph.events("scheduler.idle"))
    client = Client(graph.address, timeout=60)
    stream = client.generate("Tell me a very long story", max_new_tokens=3000, ignore_eos=True,
                             stream=True)
    next(stream)
    client.close()  # the client library aborts what it leaves open
    found = graph.wait_for("request.client_abort", timeout=20)
    assert found, "the server did not notice the client leaving"
    ended = graph.wait_for("request.ended", timeout=20, rid=found[-1]["rid"])
    assert ended and ended[0]["reason"] == "abort" and ended[0]["completion_tokens"] < 3000
    assert graph.idle_again(idle_before)
