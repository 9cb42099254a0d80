"""Prompts and outputs never reach the logs above debug level: a distinctive prompt, sent over
both APIs, served, streamed and refused, is found nowhere in an info-level log file, nor is
the text the server answered. The graph binds every interface with no key, so it also says
so (server.insecure_bind)."""

from __future__ import annotations

import json
import urllib.request

import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin
from protocol.client import Client, ServerError

pytestmark = pytest.mark.slow

MARKER = "zebra-quartz-1729"


def _http(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def test_prompts_and_outputs_stay_out_of_info_logs(model_cache, tmp_path):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    log_file = tmp_path / "graph.jsonl"
    g = Graph("model.builtin=qwen3-tiny", "log.level=info", f'log.file="{log_file}"',
              "server.host=0.0.0.0")
    try:
        outputs = []
        with Client(g.address, timeout=60) as c:
            prompt = f"Tell me about {MARKER} today"
            outputs.append(c.generate(prompt, max_new_tokens=16, ignore_eos=True).text)
            outputs.append(list(c.generate(prompt + " again", max_new_tokens=16,
                                           ignore_eos=True, stream=True))[-1].text)
            c.generate([{"role": "user", "content": MARKER}], max_new_tokens=4)
            c.generate("Hello", max_new_tokens=4, stop=[MARKER])
            with pytest.raises(ServerError):  # refused: max_new_tokens must be at least 1
                c.generate(MARKER, max_new_tokens=0)
        body = {"model": "qwen3-tiny", "max_tokens": 16, "temperature": 0, "ignore_eos": True}
        r = _http(f"{g.http}/v1/completions", {**body, "prompt": f"{MARKER} via http"})
        outputs.append(r["choices"][0]["text"])
        r = _http(f"{g.http}/v1/chat/completions",
                  {**body, "messages": [{"role": "user", "content": f"{MARKER} chat"}]})
        outputs.append(r["choices"][0]["message"]["content"])
        assert g.wait_for("request.finished", timeout=10)
    finally:
        assert g.stop() == 0
    text = log_file.read_text()
    records = [json.loads(line) for line in text.splitlines()]
    assert any(r["event"] == "request.finished" for r in records)
    assert any(r["event"] == "request.rejected" for r in records)
    assert MARKER not in text
    for out in outputs:
        assert len(out) >= 8 and out not in text, out
    assert all(r["level"] != "debug" for r in records)
    warned = [r for r in records if r["event"] == "server.insecure_bind"]
    assert warned and warned[0]["host"] == "0.0.0.0" and warned[0]["endpoints"] == ["zmq", "http"]
