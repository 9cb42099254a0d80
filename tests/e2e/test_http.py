"""The OpenAI-compatible HTTP API, driven by the official `openai` package, unmodified."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import anthropic
import openai
import pytest

from harness.graph import Graph
from protocol.client import Client

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def api(graph):
    return openai.OpenAI(base_url=graph.http + "/v1", api_key="unused", max_retries=0)


def test_completion_equals_the_zmq_reply_with_usage(graph, api):
    r = api.completions.create(model="qwen3-tiny", prompt="The capital of France is",
                               max_tokens=12, temperature=0)
    with Client(graph.address, timeout=60) as c:
        z = c.generate("The capital of France is", max_new_tokens=12)
    assert r.object == "text_completion" and r.choices[0].text == z.text
    assert r.choices[0].finish_reason == z.finish_reason
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (z.prompt_tokens, 12)
    assert r.usage.total_tokens == z.prompt_tokens + 12
    # The second identical prompt hits the prefix cache.
    again = api.completions.create(model="qwen3-tiny", prompt="The capital of France is",
                                   max_tokens=12, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    assert again.choices[0].text == r.choices[0].text


def test_chat_stream_concatenates_to_the_whole_reply_and_reports_usage(api):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "你好 🎉"}]
    whole = api.chat.completions.create(model="qwen3-tiny", messages=msgs, max_tokens=16,
                                        temperature=0)
    chunks = list(api.chat.completions.create(model="qwen3-tiny", messages=msgs, max_tokens=16,
                                              temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert text == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and
              c.choices[0].finish_reason]
    assert finals == [whole.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == \
        whole.usage.completion_tokens


def test_n_choices_and_stop_strings(api):
    r = api.completions.create(model="qwen3-tiny", prompt="Once upon a time", max_tokens=8,
                               temperature=0, n=3)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert len({c.text for c in r.choices}) == 1  # greedy: the same three times
    assert r.usage.completion_tokens == 3 * 8
    # The prompt was computed once: the other choices reused it from the prefix cache.
    assert r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
    text = r.choices[0].text
    stop = text[len(text) // 2: len(text) // 2 + 3]
    assert stop.strip(), text
    cut = api.completions.create(model="qwen3-tiny", prompt="Once upon a time", max_tokens=8,
                                 temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]


def test_models_health_metrics(graph, api):
    assert [m.id for m in api.models.list().data] == ["qwen3-tiny"]
    # A reply of its own: the KV pages come with the scheduler's batches.
    api.completions.create(model="qwen3-tiny", prompt="Metrics", max_tokens=2)
    import urllib.request
    with urllib.request.urlopen(graph.http + "/health") as h:
        assert h.status == 200
    with urllib.request.urlopen(graph.http + "/metrics") as h:
        body = h.read().decode()
    for name in ("mas:time_to_first_token_seconds_bucket", "mas:inter_token_latency_seconds",
                 "mas:num_requests_running", "mas:prompt_tokens_total",
                 "mas:generation_tokens_total", "mas:prefix_cache_hit_rate"):
        assert name in body, name
    total = [line for line in body.splitlines() if line.startswith("mas:generation_tokens_total")]
    assert float(total[0].split()[-1]) > 0
    # The one KV pool, in pages of 16 tokens and in bytes, as the scheduler last counted it.
    values = dict(line.rsplit(" ", 1) for line in body.splitlines() if line[:1] != "#")
    pages = {s: int(values[f'mas:kv_pages{{model_name="qwen3-tiny",state="{s}"}}'])
             for s in ("total", "used", "cached", "free")}
    assert pages["total"] > 0 and pages["used"] + pages["free"] == pages["total"]
    assert pages["cached"] <= pages["used"]
    page_bytes = int(values['mas:kv_pool_bytes{model_name="qwen3-tiny",state="total"}']) \
        // pages["total"]
    assert page_bytes > 0 and page_bytes % 16 == 0
    for state, n in pages.items():
        assert int(values[f'mas:kv_pool_bytes{{model_name="qwen3-tiny",state="{state}"}}']) \
            == n * page_bytes


def test_bad_requests_get_400_in_the_openai_shape(api):
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="qwen3-tiny", prompt="hi", max_tokens=4, temperature=101)
    assert "temperature" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="qwen3-tiny", prompt="", max_tokens=4)
    assert "empty prompt" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        api.completions.create(model="qwen3-tiny", prompt="hi", max_tokens=4,
                               logit_bias={"999999999": 1.0})
    assert "logit_bias" in str(e.value)
    ok = api.completions.create(model="qwen3-tiny", prompt="hi", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens == 2


def test_a_client_that_disconnects_mid_stream_frees_its_row(graph):
    host, port = graph.http[len("http://"):].split(":")
    body = json.dumps({"model": "qwen3-tiny", "prompt": "Tell me a long story",
                       "max_tokens": 3000, "ignore_eos": True, "stream": True}).encode()
    idle_before = len(graph.events("scheduler.idle"))
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        got = b""
        while b"data:" not in got:  # streaming has begun
            got += s.recv(4096)
    found = graph.wait_for("request.client_gone", timeout=20)
    assert found, "the server did not notice the client leaving"
    rid = found[-1]["rid"]
    ended = graph.wait_for("request.ended", timeout=20, rid=rid)
    assert ended and ended[0]["reason"] == "abort" and ended[0]["completion_tokens"] < 3000
    assert graph.idle_again(idle_before)


@pytest.fixture(scope="module")
def slow_graph(model_cache):
    """Prefill made slow on purpose (the reference BLAS, small chunks): seconds for a long
    prompt, so a client can leave well before its first token on any machine."""
    g = Graph("model.builtin=qwen3-tiny", "runtime.blas=bundled",
              "scheduler.chunked_prefill_size=128")
    yield g
    assert g.stop() == 0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_gone_during_prefill_is_aborted_before_its_first_token(slow_graph, stream):
    graph = slow_graph
    host, port = graph.http[len("http://"):].split(":")
    # About 3,500 prompt tokens in 28 chunks, over a second; and the runner is held (SIGSTOP)
    # from the moment the request is in until the server has noticed the client leave, so
    # the prompt is still being prefilled then on any machine.
    runner = graph.actor_pids()["runner"]
    prompt = " ".join(f"item {i}," for i in range(600))
    body = json.dumps({"model": "qwen3-tiny", "prompt": prompt, "max_tokens": 50,
                       "stream": stream}).encode()
    idle_before = len(graph.events("scheduler.idle"))
    received = len(graph.events("request.received"))
    gone = len(graph.events("request.client_gone"))
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        deadline = time.monotonic() + 20
        while len(graph.events("request.received")) == received and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(runner, signal.SIGSTOP)
    try:
        deadline = time.monotonic() + 20
        while len(graph.events("request.client_gone")) == gone and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        os.kill(runner, signal.SIGCONT)
    found = graph.events("request.client_gone")[gone:]
    assert found and found[0]["rid"] == graph.events("request.received")[received]["rid"]
    ended = graph.wait_for("request.ended", timeout=20, rid=found[0]["rid"])
    assert ended and ended[0]["reason"] == "abort" and ended[0]["completion_tokens"] == 0
    assert graph.idle_again(idle_before), "\n".join(
        f"{r.get('actor')} {r.get('event')} {r.get('rid', '')} {r.get('error', '')}"
        for r in graph.records[-40:])


def test_api_key_guards_every_route_but_health(model_cache):
    g = Graph("model.builtin=qwen3-tiny", "server.api_key=sekrit")
    try:
        bad = openai.OpenAI(base_url=g.http + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        good = openai.OpenAI(base_url=g.http + "/v1", api_key="sekrit", max_retries=0)
        assert good.completions.create(model="qwen3-tiny", prompt="hi", max_tokens=2,
                                       temperature=0).usage.completion_tokens == 2
        # Anthropic's clients send the key as x-api-key, and get errors in Anthropic's shape.
        hi = dict(model="qwen3-tiny", max_tokens=2, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(anthropic.AuthenticationError) as e:
            anthropic.Anthropic(base_url=g.http, api_key="wrong",
                                max_retries=0).messages.create(**hi)
        assert e.value.body["type"] == "error" and \
            e.value.body["error"]["type"] == "authentication_error"
        claude = anthropic.Anthropic(base_url=g.http, api_key="sekrit", max_retries=0)
        assert claude.messages.create(**hi).usage.output_tokens == 2
        import urllib.request
        with urllib.request.urlopen(g.http + "/health") as h:
            assert h.status == 200
    finally:
        assert g.stop() == 0


def test_seeded_http_requests_repeat_and_n_seeded_choices_differ(api):
    kw = dict(model="qwen3-tiny", prompt="Roll the dice:", max_tokens=10, temperature=1.0,
              seed=42)
    a = api.completions.create(**kw)
    b = api.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text
    many = api.completions.create(**kw, n=2)
    assert many.choices[0].text == a.choices[0].text  # choice k uses seed + k
    assert many.choices[1].text != many.choices[0].text
    chat = api.chat.completions.create(
        model="qwen3-tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert chat.usage.completion_tokens == 4


def test_overload_is_a_503_at_once_and_metrics_show_the_queue(model_cache):
    import threading
    import urllib.request

    g = Graph("model.builtin=qwen3-tiny", "scheduler.max_running_requests=1",
              "scheduler.max_queued_requests=1")
    try:
        api = openai.OpenAI(base_url=g.http + "/v1", api_key="x", max_retries=0)
        long = dict(model="qwen3-tiny", prompt="Go on and on", max_tokens=400,
                    extra_body={"ignore_eos": True})
        first = api.completions.create(**long, stream=True)
        next(iter(first))  # running
        waiting = threading.Thread(target=lambda: api.completions.create(**long))
        waiting.start()
        deadline = time.monotonic() + 20
        body = ""
        while "mas:num_requests_waiting{model_name=\"qwen3-tiny\"} 1" not in body:
            assert time.monotonic() < deadline, body
            time.sleep(0.2)
            with urllib.request.urlopen(g.http + "/metrics") as h:
                body = h.read().decode()
        t0 = time.monotonic()
        with pytest.raises(openai.InternalServerError) as e:
            api.completions.create(model="qwen3-tiny", prompt="one more", max_tokens=4)
        assert e.value.status_code == 503 and "queue full" in str(e.value)
        assert time.monotonic() - t0 < 5  # at once, not after the queue drained
        first.close()
        waiting.join(120)
    finally:
        assert g.stop() == 0
