"""Any local mlx-lm model directory through `model.path` (here the hybrid Qwen3.5 built-in),
chat templates, and JSON logs to a file."""

from __future__ import annotations

import asyncio
import json

import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol.client import AsyncClient, Client
from harness.oracle import Oracle

pytestmark = pytest.mark.slow

PROMPTS = ["Hello world", "中文的自然语言处理很有趣", "🎉 emoji and code: x = [1, 2, 3]",
           "A longer prompt about many things. " * 30]


async def _all(address: str, n: int):
    async with AsyncClient(address) as client:
        return await asyncio.gather(*[client.generate(p, max_new_tokens=n) for p in PROMPTS])


def test_hybrid_model_by_path_matches_mlx_lm_with_chat_and_log_file(model_cache, tmp_path):
    path = ensure_builtin("qwen3_5-tiny", cache_dir=model_cache, progress=False)
    log_file = tmp_path / "logs" / "serve.jsonl"
    g = Graph(f"model.path={path}", f"log.file={log_file}")
    try:
        replies = asyncio.run(asyncio.wait_for(_all(g.address, 16), 120))
        oracle = Oracle(str(path))
        for prompt, reply in zip(PROMPTS, replies):
            ids = oracle.tokenizer.encode(prompt)
            oracle.check(ids, reply.token_ids, oracle.greedy(ids, 16))

        chat = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "你好"}]
        with Client(g.address, timeout=60) as client:
            reply = client.generate(chat, max_new_tokens=8)
        ids = oracle.tokenizer.apply_chat_template(chat, add_generation_prompt=True)
        text = oracle.tokenizer.decode(ids)
        assert text.startswith("<|im_start|>system\nYou are terse.<|im_end|>\n")
        assert text.endswith("<|im_start|>assistant\n")
        assert reply.prompt_tokens == len(ids)
        oracle.check(ids, reply.token_ids, oracle.greedy(ids, 8))
    finally:
        assert g.stop() == 0
    records = [json.loads(line) for line in log_file.read_text().splitlines()]
    actors = {r["actor"] for r in records}
    assert actors == {"launcher", "tokenizer", "scheduler", "runner", "detokenizer"}
    assert all(isinstance(r["pid"], int) for r in records)
    assert any(r["event"] == "request.finished" and r.get("rid") for r in records)
