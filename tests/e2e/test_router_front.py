"""Two of our servers behind the real sglang-router (cache_aware policy), used through the
official openai client: streamed chat and completions pass through, a repeated long prefix lands
on the server that cached it, and requests keep succeeding after one server is killed."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from harness.graph import Graph
from models.builtin import ensure_builtin

pytestmark = pytest.mark.slow
openai = pytest.importorskip("openai")
pytest.importorskip("sglang_router")

# Fail over within a couple of seconds (the defaults answer a few 500s first): every failure
# counts, the health check runs each second, and a failed request is retried elsewhere. A
# killed server refuses the check at once; a live one on a loaded machine may take longer than
# the router's 5 s default to answer (an idle server's /health sends a probe through its
# graph), which with one failure counting took a live server out of the fleet (503s).
FAILOVER = ["--health-failure-threshold", "1", "--health-check-interval-secs", "1",
            "--health-check-timeout-secs", "30",
            "--cb-failure-threshold", "1", "--retry-max-retries", "3"]
SHARED = "You are a careful assistant. Here is a long shared context for every question. " * 8


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_http(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if time.monotonic() > deadline:
                raise
        time.sleep(0.3)


@pytest.fixture
def fleet(model_cache, tmp_path):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    servers = [Graph("model.builtin=qwen3-tiny") for _ in range(2)]
    port = _free_port()
    log = open(tmp_path / "router.log", "w")
    router = subprocess.Popen(
        [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
         "--port", str(port), "--policy", "cache_aware", "--worker-urls",
         *[s.started.http for s in servers], *FAILOVER],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_http(f"http://127.0.0.1:{port}/health", 60)
        _wait_http(f"http://127.0.0.1:{port}/v1/models", 60)  # a worker is in the fleet
        yield servers, openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                     max_retries=0, timeout=60)
    finally:
        router.terminate()
        router.wait(10)
        log.close()
        for s in servers:
            s.stop()


def _received(server: Graph) -> int:
    return sum(1 for r in server.records if r.get("event") == "request.received")


def test_two_servers_behind_sglang_router(fleet):
    servers, client = fleet
    models = client.models.list()
    assert [m.id for m in models.data] == ["qwen3-tiny"]  # from our /server_info

    chat = client.chat.completions.create(
        model="qwen3-tiny", messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=6, stream=True, temperature=0)
    pieces = [c for c in chat if c.choices]
    assert pieces and pieces[-1].choices[0].finish_reason == "length"
    comp = client.completions.create(model="qwen3-tiny", prompt="Once upon a time",
                                     max_tokens=6, stream=True, temperature=0)
    texts = [c.choices[0].text for c in comp if c.choices]
    assert "".join(texts)

    # A long prefix sent again lands where it was cached.
    before = [_received(s) for s in servers]
    first = client.completions.create(model="qwen3-tiny", prompt=SHARED + "Question A?",
                                      max_tokens=4, temperature=0)
    second = client.completions.create(model="qwen3-tiny", prompt=SHARED + "Question B?",
                                       max_tokens=4, temperature=0)
    got = [_received(s) - b for s, b in zip(servers, before)]
    assert sorted(got) == [0, 2], got
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert first.usage.prompt_tokens_details.cached_tokens == 0

    # One server dies: the router takes it out and the next requests still succeed.
    victim = servers[got.index(2)]
    victim.started.proc.kill()
    victim.started.proc.wait(30)
    ok = 0
    for i in range(6):
        reply = client.completions.create(model="qwen3-tiny", prompt=SHARED + f"After {i}?",
                                          max_tokens=3, temperature=0)
        ok += reply.usage.completion_tokens == 3
    assert ok == 6


def test_vllm_router_tokenize_endpoint(model_cache):
    """What vllm-router asks each worker to route by cache: POST /tokenize."""
    import json

    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    g = Graph("model.builtin=qwen3-tiny")
    try:
        def post(body: dict) -> tuple[int, dict]:
            req = urllib.request.Request(f"{g.started.http}/tokenize",
                                         data=json.dumps(body).encode(), method="POST",
                                         headers={"content-type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=30) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        status, got = post({"model": "qwen3-tiny", "prompt": "Hello world"})
        assert status == 200 and got["tokens"] == [9707, 1879] and got["count"] == 2
        assert got["max_model_len"] > 0
        status, chat = post({"messages": [{"role": "user", "content": "Hi"}]})
        assert status == 200 and chat["count"] == len(chat["tokens"]) > 3
        status, err = post({"prompt": "a", "messages": [{"role": "user", "content": "b"}]})
        assert status == 400 and "one of prompt or messages" in err["error"]["message"]
        with urllib.request.urlopen(f"{g.started.http}/server_info", timeout=30) as r:
            info = json.loads(r.read())
        assert info["served_model_name"] == "qwen3-tiny" and info["dp_size"] == 1
    finally:
        assert g.stop() == 0
