"""The whole graph on the built-in Qwen3 model: real processes, real ZMQ sockets, real tokenizer.
Greedy token ids must equal mlx_lm.generate on the same model and prompt."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import msgspec
import pytest
import zmq

from harness.graph import ROOT, Graph
from models.builtin import ensure_builtin
from protocol import messages as m
from protocol.client import AsyncClient, Client, ServerError
from harness.oracle import Oracle
from tests.support.prompts import PROMPTS
from tests.support.streams import abort_a_stream

pytestmark = pytest.mark.slow

MAX_NEW = 24


@pytest.fixture(scope="module")
def graph(model_cache):
    ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)
    g = Graph("model.builtin=qwen3-tiny", "scheduler.max_running_requests=8")
    yield g
    assert g.stop() == 0


@pytest.fixture(scope="module")
def oracle(model_cache):
    return Oracle(str(ensure_builtin("qwen3-tiny", cache_dir=model_cache, progress=False)))


@pytest.fixture(scope="module")
def prompt_ids(oracle):
    return [oracle.tokenizer.encode(p) for p in PROMPTS]


async def _concurrent(address: str, n_clients: int = 3) -> list[m.Finished]:
    clients = [AsyncClient(address) for _ in range(n_clients)]
    try:
        return await asyncio.wait_for(asyncio.gather(*[
            clients[i % n_clients].generate(p, max_new_tokens=MAX_NEW)
            for i, p in enumerate(PROMPTS)]), 120)
    finally:
        for c in clients:
            await c.close()


def test_concurrent_replies_equal_mlx_lm_and_alone(graph, oracle, prompt_ids):
    batched = asyncio.run(_concurrent(graph.address))
    with Client(graph.address, timeout=60) as client:
        alone = [client.generate(p, max_new_tokens=MAX_NEW) for p in PROMPTS]
    assert len(prompt_ids[6]) > 1000  # the long prompt really is long
    for ids, b, a in zip(prompt_ids, batched, alone):
        ref = oracle.greedy(ids, MAX_NEW)
        assert b.prompt_tokens == len(ids)
        oracle.check(ids, b.token_ids, ref)
        oracle.check(ids, a.token_ids, ref)
        if b.token_ids != a.token_ids:  # only a proven near-tie may split them
            oracle.check(ids, b.token_ids, a.token_ids)
        assert b.finish_reason in ("stop", "length")
        assert b.completion_tokens == len(b.token_ids)
    # The continuations are varied, so matching proves something.
    assert len({tuple(r.token_ids) for r in batched}) == len(PROMPTS)
    assert all(len(set(r.token_ids)) > 4 for r in batched if len(r.token_ids) == MAX_NEW)


def test_streamed_deltas_concatenate_to_the_final_text(graph, oracle):
    with Client(graph.address, timeout=60) as client:
        for prompt in (PROMPTS[2], PROMPTS[4], PROMPTS[0]):
            pieces = list(client.generate(prompt, max_new_tokens=MAX_NEW, stream=True))
            final = pieces[-1]
            deltas = pieces[:-1]
            assert isinstance(final, m.Finished) and all(isinstance(d, str) for d in deltas)
            whole = client.generate(prompt, max_new_tokens=MAX_NEW)
            # Equal to the one-shot decode of every id: no delta split a character (a split
            # would leave U+FFFD in the joined text that the whole decode does not have).
            assert "".join(deltas) == whole.text
            eos = set(oracle.tokenizer.eos_token_ids)
            assert whole.text == oracle.tokenizer.decode([t for t in whole.token_ids
                                                          if t not in eos])


async def _abort_one(address: str):
    async with AsyncClient(address) as client:
        others = [asyncio.ensure_future(client.generate(p, max_new_tokens=MAX_NEW))
                  for p in PROMPTS[:3]]
        final = await abort_a_stream(client)
        return final, await asyncio.wait_for(asyncio.gather(*others), 60)


def test_abort_of_a_running_request_ends_it_and_others_continue(graph):
    final, others = asyncio.run(asyncio.wait_for(_abort_one(graph.address), 120))
    assert final.finish_reason == "abort"
    assert 3 <= final.completion_tokens < 2000
    assert all(o.finish_reason in ("stop", "length") for o in others)


KILLED_CLIENT = """
import sys
from protocol.client import Client
client = Client(sys.argv[1], timeout=60)
for piece in client.generate("Tell me a long story", max_new_tokens=3000, ignore_eos=True,
                             stream=True, req_id="doomed"):
    print("streaming", flush=True)
    break
sys.stdin.read()  # held open until killed: no close, no abort from the library
"""


def test_a_killed_zmq_client_is_noticed_and_its_row_freed(graph):
    idle_before = len(graph.events("scheduler.idle"))
    victim = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, graph.address],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert victim.stdout.readline().strip() == "streaming"
    finally:
        victim.kill()
        victim.wait()
    found = graph.wait_for("request.client_gone", timeout=20, req_id="doomed")
    assert found, "the server did not notice the client's connection closing"
    ended = graph.wait_for("request.ended", timeout=20, rid=found[-1]["rid"])
    assert ended and ended[0]["reason"] == "abort" and ended[0]["completion_tokens"] < 3000
    assert graph.idle_again(idle_before)
    with Client(graph.address, timeout=60) as client:  # and the server serves on
        assert client.generate("Hello world", max_new_tokens=4).finish_reason == "length"


BAD = [
    ([b"not msgpack \xc1"], "invalid request"),
    ([b"\x93\x01\x02\x03"], "invalid request"),  # an array, not a request map
    ([b"a", b"b"], "expected 1 payload frame"),
    ([msgspec.msgpack.encode({"type": 99, "req_id": "x"})], "invalid request"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "x", "prompt": "hi",
                              "max_new_tokens": "ten"})], "max_new_tokens"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "x", "prompt": "hi",
                              "max_new_tokens": 0})], "max_new_tokens"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "x", "prompt": "hi",
                              "temperature": -1.0})], "temperature"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "x", "prompt": "hi",
                              "max_tokens": 5})], "max_tokens"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "x", "prompt": ""})], "empty prompt"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "x", "input_ids": [1, 10**9]})],
     "outside the vocabulary"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "x", "prompt": "word " * 41000})],
     "context"),
    ([msgspec.msgpack.encode({"type": 1, "req_id": "", "prompt": "hi"})], "req_id"),
]


def test_bad_requests_get_error_replies_and_the_server_keeps_serving(graph):
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 30000)
    sock.connect(graph.address)
    dec = msgspec.msgpack.Decoder(m.ClientOutbound)
    try:
        for frames, expected in BAD:
            sock.send_multipart(frames)
            reply = dec.decode(sock.recv())
            assert isinstance(reply, m.ErrorReply), (frames, reply)
            assert expected in reply.message, (expected, reply.message)
            assert reply.code == 400
    finally:
        sock.close()
        ctx.term()
    with Client(graph.address, timeout=60) as client:
        with pytest.raises(ServerError, match="empty prompt"):
            client.generate("")
        ok = client.generate("Hello world", max_new_tokens=4)
        assert ok.finish_reason == "length" and len(ok.token_ids) == 4, ok


def test_lifecycle_is_in_the_logs_with_rids(graph):
    with Client(graph.address, timeout=60) as client:
        client.generate("Hello world", max_new_tokens=3, req_id="lifecycle")
    # Earlier tests' requests are in the same log: find this one's rid by its req_id.
    received = graph.wait_for("request.received", actor="tokenizer", req_id="lifecycle")
    assert received, "no request.received event"
    rid = received[-1]["rid"]
    done = graph.wait_for("request.finished", actor="tokenizer", rid=rid)
    assert done, "no request.finished event"
    for event, actor in [("request.received", "tokenizer"), ("request.admitted", "scheduler"),
                         ("request.first_token", "tokenizer")]:
        found = graph.events(event, rid=rid)
        assert found and found[0]["actor"] == actor and isinstance(found[0]["pid"], int)
    assert done[-1]["completion_tokens"] == 3 and done[-1]["ttft_s"] > 0
