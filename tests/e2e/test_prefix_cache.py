"""The radix prefix cache through the real graph, on the dense (qwen3) and the hybrid
(qwen3_5, recurrent state restored from snapshots) built-in models: greedy token ids are
identical with the cache on and off, and replies report cached_tokens where a hit is expected."""

from __future__ import annotations

import asyncio

import pytest
from mlx_lm.utils import load_tokenizer

from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient, Client

pytestmark = pytest.mark.slow

SYSTEM = "You are a careful assistant who answers briefly. " * 12
MAX_NEW = 12


def _sequential(address: str) -> dict[str, object]:
    """(a) the same prompt twice, (b) one long system prompt with different user turns,
    (c) a multi-turn chat where each turn appends to the last."""
    out = {}
    with Client(address, timeout=120) as c:
        out["a1"] = c.generate("The quick brown fox jumps over the lazy dog. " * 8,
                               max_new_tokens=MAX_NEW)
        out["a2"] = c.generate("The quick brown fox jumps over the lazy dog. " * 8,
                               max_new_tokens=MAX_NEW)
        for k, q in enumerate(["What is rain?", "Name a color.", "Count to three."]):
            out[f"b{k}"] = c.generate([{"role": "system", "content": SYSTEM},
                                       {"role": "user", "content": q}], max_new_tokens=MAX_NEW)
        chat = [{"role": "system", "content": SYSTEM}]
        for k, q in enumerate(["Hello!", "Tell me more.", "And then?"]):
            chat.append({"role": "user", "content": q})
            out[f"c{k}"] = reply = c.generate(chat, max_new_tokens=MAX_NEW)
            chat.append({"role": "assistant", "content": reply.text})
    return out


async def _concurrent(address: str) -> dict[str, object]:
    """(d) concurrent requests sharing a long prefix (cached at chunk boundaries)."""
    async with AsyncClient(address) as c:
        prompts = {f"d{k}": SYSTEM + f" Question {k}: what comes after {k}?" for k in range(5)}
        replies = await asyncio.gather(*[c.generate(p, max_new_tokens=MAX_NEW)
                                         for p in prompts.values()])
        # (f) n = 3 seeded choices of one prompt, sent as a group: computed once, cache or not.
        choices = await asyncio.gather(*[
            c.generate(SYSTEM + " Write a poem.", max_new_tokens=MAX_NEW, temperature=0.8,
                       seed=k, group="poem") for k in range(3)])
        return dict(zip(prompts, replies)) | {f"f{k}": r for k, r in enumerate(choices)}


def _document(k: int) -> str:
    return f"Document {k}. " + f"Paragraph {k} text goes here. " * 40


def _evicting(address: str) -> dict[str, object]:
    """(e) more distinct long prompts than the KV budget holds, then the first one again."""
    out = {}
    with Client(address, timeout=120) as c:
        for k in range(5):
            out[f"e{k}"] = c.generate(_document(k), max_new_tokens=MAX_NEW)
        out["e0-again"] = c.generate(_document(0), max_new_tokens=MAX_NEW)
    return out


def _shared_with_later_documents(model_dir) -> tuple[int, int]:
    """(the tokens of document 0, the longest prefix they share with documents 1-4): what a
    cache that holds only the later documents can still give document 0."""
    tokenizer = load_tokenizer(model_dir)
    ids = [tokenizer.encode(_document(k)) for k in range(5)]

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    return len(ids[0]), max(common(ids[0], other) for other in ids[1:])


def _serve(model: str, *overrides: str) -> dict[str, object]:
    g = Graph(f"model.builtin={model}", "scheduler.chunked_prefill_size=64", *overrides)
    try:
        out = _sequential(g.address)
        out.update(asyncio.run(asyncio.wait_for(_concurrent(g.address), 120)))
        out.update(_evicting(g.address))
    finally:
        assert g.stop() == 0
    assert g.events("scheduler.leak") == []
    out["_graph"] = g
    return out


@pytest.mark.parametrize("model", ["qwen3-tiny", "qwen3_5-tiny"])
def test_prefix_cache_on_and_off_give_the_same_tokens(model_cache, model):
    model_dir = ensure_builtin(model, cache_dir=model_cache, progress=False)
    off = _serve(model, "cache.prefix=false")
    # A KV budget that holds about two of the (e) documents: the others evict them.
    on = _serve(model, "cache.prefix=true", "memory.kv_tokens=1200")
    keys = [k for k in off if not k.startswith("_")]
    for k in keys:
        assert on[k].token_ids == off[k].token_ids, f"{model} {k}: cache on != off"
        assert off[k].cached_tokens == 0 or k.startswith("f")
    # One choice computed the prompt, the others loaded it: a dense model's without its last
    # token (they run it for its logits), a hybrid's whole, with the head's input kept there.
    left = 0 if model.startswith("qwen3_5") else 1
    for run in (on, off):
        cached = sorted(run[f"f{k}"].cached_tokens for k in range(3))
        assert cached[1] == cached[2] == run["f0"].prompt_tokens - left and cached[0] < cached[1]
    assert len({tuple(off[f"f{k}"].token_ids) for k in range(3)}) > 1
    hits = {k: on[k].cached_tokens for k in keys}
    # A hybrid model resumes only where a state snapshot exists: at chunk boundaries (64
    # tokens here) and where a request ended. A dense one resumes anywhere.
    shared = 64 if model.startswith("qwen3_5") else 100
    assert hits["a1"] == 0 and hits["a2"] > 60
    assert all(hits[f"b{k}"] >= shared for k in (1, 2))
    assert hits["c0"] > 0 and hits["c1"] > hits["c0"]
    if shared == 64:
        # A reply re-tokenized from its text may differ from the generated ids: the hybrid
        # model then resumes from the last snapshot before that point.
        assert hits["c2"] >= hits["c1"]
    else:
        assert hits["c2"] > hits["c1"]
    assert sum(hits[f"d{k}"] > 0 for k in range(5)) >= 2
    # Document 0 was evicted by the later documents: its second send finds at most the few
    # tokens every document starts with ("Document "), none of its own (kept, it would resume
    # past 64 tokens as a2 did).
    length, shared = _shared_with_later_documents(model_dir)
    assert on["e0-again"].prompt_tokens == on["e0"].prompt_tokens == length
    assert shared < 64 and hits["e0"] <= shared
    assert hits["e0-again"] <= shared, (hits["e0-again"], shared)
    g = on["_graph"]
    assert g.events("cache.evict"), "the budget was meant to force eviction"
    assert g.events("cache.hit") and g.events("scheduler.config")[0]["prefix_cache"]
    if model.startswith("qwen3_5"):
        assert g.events("scheduler.config")[0]["state_slots"] > 0


SHORT = ["Hi!", "What is rain?", "Name a color.", "Count to three.", "Tell me a joke.",
         "2 + 2 =", "Why is the sky blue?", "Say hello in French.", "List two fruits.",
         "Good morning"]


@pytest.mark.parametrize("builtin", ["qwen3_5-tiny", "qwen3-tiny"])
def test_short_prompts_sent_twice_hit_the_cache(model_cache, builtin):
    """A short prompt's state is snapshotted before its last token (hybrid), so a repeat or a
    retry resumes there, computing one token, with the same tokens as the first send."""
    ensure_builtin(builtin, cache_dir=model_cache, progress=False)
    g = Graph(f"model.builtin={builtin}")
    try:
        with Client(g.address, timeout=120) as c:
            pairs = [(c.generate(p, max_new_tokens=6), c.generate(p, max_new_tokens=6))
                     for p in SHORT]
    finally:
        assert g.stop() == 0
    hits = [second.cached_tokens >= second.prompt_tokens - 1 for _, second in pairs]
    assert sum(hits) >= 9, [(f.cached_tokens, s.cached_tokens, s.prompt_tokens)
                            for f, s in pairs]
    assert all(first.token_ids == second.token_ids for first, second in pairs)
