"""The client library's Result of a streamed request is the one a plain request gets: the
whole text and every token id (the wire's streamed Finished carries no text of its own)."""

from __future__ import annotations

import asyncio

import pytest

from protocol import messages as m
from protocol.client import AsyncClient, Client

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"
KW = dict(max_new_tokens=16, ignore_eos=True, temperature=0.0)


def test_streamed_and_plain_results_are_equal(graph):
    with Client(graph.address, timeout=60) as c:
        plain = c.generate(PROMPT, **KW)
        pieces = list(c.generate(PROMPT, stream=True, **KW))
    final = pieces[-1]
    assert isinstance(final, m.Finished) and all(isinstance(p, str) for p in pieces[:-1])
    assert plain.text and final.text == plain.text == "".join(pieces[:-1])
    assert final.token_ids == plain.token_ids and len(plain.token_ids) == 16
    assert final.completion_tokens == plain.completion_tokens


def test_async_streamed_and_plain_results_are_equal(graph):
    async def both() -> tuple[m.Finished, list]:
        async with AsyncClient(graph.address) as c:
            plain = await c.generate(PROMPT, **KW)
            stream = await c.generate(PROMPT, stream=True, **KW)
            return plain, [p async for p in stream]

    plain, pieces = asyncio.run(asyncio.wait_for(both(), 60))
    assert pieces[-1].text == plain.text == "".join(pieces[:-1]) and plain.text
    assert pieces[-1].token_ids == plain.token_ids
