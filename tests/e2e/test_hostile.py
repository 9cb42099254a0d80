"""Hostile input on both APIs (the fuzz job's repros): every frame and body below once killed the
graph, returned a 500 or left a request open. Each must now get one 4xx reply naming the
problem, on the same running graph, which then still serves."""

from __future__ import annotations

import math
import random
import signal
import threading

import json
import urllib.error
import urllib.request
import msgspec
import pytest
import zmq

from harness.graph import Graph
from protocol import messages as m
from protocol.client import Client

pytestmark = pytest.mark.slow

_dec = msgspec.msgpack.Decoder(m.ClientOutbound)


def _frame(**fields) -> bytes:
    return msgspec.msgpack.encode({"type": 1, "req_id": "x", "max_new_tokens": 2, **fields})


def _deep(levels: int) -> bytes:
    """A msgpack value nested `levels` arrays deep: [[[...[nil]...]]]."""
    return b"\x91" * levels + b"\xc0"


BAD_FRAMES = [
    # 1. invalid UTF-8 in a prompt, a req_id, a message role, a map key
    (_frame(prompt="PROMPT").replace(b"PROMPT", b"PR\xffMPT"), "UTF-8"),
    (_frame(req_id="RQ", prompt="hi").replace(b"RQ", b"R\xfe"), "UTF-8"),
    (_frame(messages=[{"role": "ROLE", "content": "hi"}]).replace(b"ROLE", b"RO\xc3E"), "UTF-8"),
    (_frame(prompt="hi").replace(b"prompt", b"pro\xffpt"), "UTF-8"),
    # 2. nesting deeper than the decoder recurses, and deeper than limits.max_depth
    (_frame(prompt="P", chat_template_kwargs={"b": 1}).replace(
        b"\x81\xa1b\x01", b"\x81\xa1a" + _deep(100_000)), "max_depth"),
    (_frame(messages=[{"role": "user", "content": "hi"}], chat_template_kwargs={"b": 1}).replace(
        b"\x81\xa1b\x01", b"\x81\xa1a" + _deep(200)), "max_depth"),
    # numbers past what the graph's wire carries
    (_frame(prompt="hi", seed=2**64 - 1), "seed"),
    (_frame(prompt="hi", max_new_tokens=2**63), "max_new_tokens"),
    (_frame(prompt="hi", temperature=math.inf), "temperature"),
    (_frame(prompt="hi", input_ids=[2**40]), "input_ids"),
    (b"\xc1", "malformed"),  # a byte msgpack never uses
]


@pytest.fixture(scope="module")
def dealer(graph):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30000)
    sock.connect(graph.address)
    yield sock
    sock.close()
    ctx.term()


@pytest.mark.parametrize("frame,expected", BAD_FRAMES, ids=range(len(BAD_FRAMES)))
def test_a_hostile_frame_gets_a_400_and_the_graph_serves_on(graph, dealer, frame, expected):
    dealer.send(frame)
    reply = _dec.decode(dealer.recv())
    assert isinstance(reply, m.ErrorReply) and reply.code == 400, reply
    assert expected in reply.message, reply.message
    with Client(graph.address, timeout=60) as client:
        assert client.generate("Hello world", max_new_tokens=2).completion_tokens == 2
    assert not graph.events("actor.crashed")


def test_random_bit_flips_each_get_exactly_one_reply(graph, dealer):
    """Every flipped frame is answered once (an error or, if the flip kept it valid, a
    result): none is dropped, none kills the graph."""
    good = _frame(req_id="flip", prompt="Hello there", max_new_tokens=1)
    rng = random.Random(7)
    for k in range(200):
        data = bytearray(good)
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        dealer.send(bytes(data))
        reply = _dec.decode(dealer.recv())
        if isinstance(reply, m.Delta):  # a flip into stream=True: read on to the end
            while isinstance(reply, m.Delta):
                reply = _dec.decode(dealer.recv())
        assert isinstance(reply, (m.ErrorReply, m.Finished)), reply
        assert not isinstance(reply, m.ErrorReply) or reply.code == 400, reply
    assert not graph.events("actor.crashed")


class Response:
    def __init__(self, status: int, text: str):
        self.status_code, self.text = status, text

    def json(self):
        return json.loads(self.text)


def test_a_new_client_on_a_reused_fd_is_not_aborted_with_the_old_one(graph):
    """Client A sends and leaves; client B connects at once (the kernel hands it A's fd) and
    sends, while a third client keeps the tokenizer reading frames: only A's request may be
    aborted."""
    ctx = zmq.Context()
    done = threading.Event()

    def flood() -> None:
        c = ctx.socket(zmq.DEALER)
        c.connect(graph.address)
        outstanding = 0
        while not done.is_set():
            while outstanding < 50:  # bounded: a send never blocks on the high-water mark
                c.send(b"\xc1")
                outstanding += 1
            if c.poll(10):
                c.recv()
                outstanding -= 1
        c.close(linger=0)

    flooder = threading.Thread(target=flood)
    flooder.start()
    try:
        for k in range(40):
            a = ctx.socket(zmq.DEALER)
            a.connect(graph.address)
            a.send(_frame(req_id=f"a{k}", prompt="Leaving soon", max_new_tokens=64,
                          ignore_eos=True))
            a.close(linger=0)
            b = ctx.socket(zmq.DEALER)
            b.setsockopt(zmq.RCVTIMEO, 60000)
            b.connect(graph.address)
            b.send(_frame(req_id=f"b{k}", prompt="Staying here", max_new_tokens=3))
            reply = _dec.decode(b.recv())
            b.close(linger=0)
            assert isinstance(reply, m.Finished) and reply.finish_reason == "length", (k, reply)
    finally:
        done.set()
        flooder.join(10)
        ctx.destroy(linger=0)  # closes a socket left open by a failed assertion


def _post(graph, path: str, body: bytes | dict) -> Response:
    content = body if isinstance(body, bytes) else msgspec.json.encode(body)
    req = urllib.request.Request(graph.http + path, data=content, method="POST",
                                 headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return Response(r.status, r.read().decode())
    except urllib.error.HTTPError as e:
        return Response(e.code, e.read().decode())


def _get(graph, path: str) -> str:
    with urllib.request.urlopen(graph.http + path, timeout=30) as r:
        return r.read().decode()


def _nested(levels: int) -> list:
    value: list = []
    for _ in range(levels):
        value = [value]
    return value


def _chat(**fields) -> dict:
    return {"model": "m", "max_tokens": 2, **fields}


BAD_BODIES = [
    # 3. content parts with a text that is not a string; deep JSON; numbers past 64 bits
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": 5}]}]), "text"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": None}]}]), "text"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "text", "text": ["a"]}]}]), "text"),
    ("/v1/chat/completions", b"[" * 5000 + b"]" * 5000, "object"),
    ("/v1/completions", b'{"prompt": "hi", "unused": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
     "max_depth"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi"}],
                                   chat_template_kwargs={"a": _nested(80)}), "max_depth"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**30}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "seed": 2**64}, "seed"),
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": "hi"}],
                                   max_completion_tokens=2**70), "max_completion_tokens"),
    # 5. one set of limits: logit_bias values outside [-100, 100] or NaN
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": 150}},
     "logit_bias"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": -1e9}},
     "logit_bias"),
    ("/v1/completions", b'{"prompt": "hi", "max_tokens": 2, "logit_bias": {"5": NaN}}',
     "malformed"),
    ("/v1/completions", b'{"prompt": "\xff\xfe"}', "UTF-8"),
    ("/v1/completions", b'{"prompt": "hi", "max_tok\xddns": 2}', "UTF-8"),  # an unknown key
    ("/v1/completions", b'{"prompt": "\\ud800"}', "malformed"),  # a lone surrogate
    ("/v1/chat/completions", _chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]), "text only"),
]


@pytest.mark.parametrize("path,body,expected", BAD_BODIES, ids=range(len(BAD_BODIES)))
def test_a_hostile_body_gets_a_400_and_the_graph_serves_on(graph, path, body, expected):
    r = _post(graph, path, body)
    assert r.status_code == 400, (r.status_code, r.text)
    error = r.json()["error"]
    assert expected in error["message"], error
    ok = _post(graph, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_limits_are_named_and_a_body_over_the_size_limit_is_413(model_cache):
    from harness.graph import Graph

    g = Graph("model.builtin=qwen3-tiny", "limits.max_body_bytes=1000",
              "limits.max_frame_bytes=1000", "limits.max_string_chars=50",
              "limits.max_stop_strings=2")
    try:
        r = _post(g, "/v1/completions", {"prompt": "x" * 2000, "max_tokens": 2})
        assert r.status_code == 413 and "limits.max_body_bytes" in r.json()["error"]["message"]
        r = _post(g, "/v1/completions", {"prompt": "x" * 60, "max_tokens": 2})
        assert r.status_code == 400 and "limits.max_string_chars" in r.text
        r = _post(g, "/v1/completions", {"prompt": "hi", "max_tokens": 2, "stop": list("abc")})
        assert r.status_code == 400 and "limits.max_stop_strings" in r.text
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 30000)
        sock.connect(g.address)
        sock.send(_frame(prompt="y" * 1500))
        reply = _dec.decode(sock.recv())
        sock.close()
        ctx.term()
        assert reply.code == 400 and "limits.max_frame_bytes" in reply.message, reply
    finally:
        assert g.stop() == 0


def test_no_refused_request_is_left_open(model_cache):
    """A request is registered only once it is encoded for the scheduler: after every refusal
    above, nothing is open, so a SIGTERM drain finds nothing to wait for (it waited its whole
    timeout for the `max_tokens: 10**30` request that was registered before it failed). A
    graph of its own: the test ends it."""
    graph = Graph("model.builtin=qwen3-tiny")
    try:
        for body in ({"prompt": "hi", "max_tokens": 10**30}, {"prompt": "hi", "seed": 2**64}):
            assert _post(graph, "/v1/completions", body).status_code == 400
        metrics = _get(graph, "/metrics")
        internal = [line for line in metrics.splitlines()
                    if line.startswith("mas:internal_errors_total")]
        assert internal and internal[0].endswith(" 0"), internal
    finally:
        assert graph.stop(signal.SIGTERM) == 0
    shutdown = graph.events("tokenizer.shutdown")
    assert shutdown and shutdown[0]["open"] == 0, shutdown
    assert not graph.events("actor.crashed")
