"""The tokenizer actor in its own process, over real sockets: clients talk to it as they would
to a server (the ZMQ client of protocol/client.py, the openai SDK over HTTP), the test plays the
scheduler (a PULL inbox receiving TokenizedRequests and Aborts) and the detokenizer (pushing
TextBatches into the tokenizer's inbox). Prompt ids are checked against the real Qwen tokenizer
of qwen3-tiny, loaded here the way the actor loads it.

The last case runs a second tokenizer whose grammar compile takes 5 s for one marked schema
(tests/support/slow_grammar.py): while it compiles, four streams keep getting their tokens on
time, and another constrained request goes through.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from protocol import messages as m
from protocol.client import Client, ServerError
from protocol.codec import encode, pack_ids, unpack_ids
from tests.support import slow_grammar
from tests.support.rig import TIMEOUT_S, Kept, Rig, make_config

pytestmark = pytest.mark.slow  # starts processes, like tests/e2e

QUIET_S = 0.3  # "nothing more comes": a healthy tokenizer forwards in milliseconds
_ids = itertools.count()


def start_tokenizer(model, entry: str | None = None) -> Rig:
    # Free ports for both client endpoints (the Ready line names them); logs at warning.
    cfg = make_config(server={"port": 0, "http_port": 0})
    rig = Rig("tokenizer", cfg, model, ("scheduler",), entry=entry).start()
    ready = rig.wait_ready()
    assert ready.info["client"].startswith("tcp://127.0.0.1:")
    assert ready.info["http"].startswith("http://127.0.0.1:")
    rig.client_address, rig.http_address = ready.info["client"], ready.info["http"]
    return rig


@pytest.fixture(scope="module")
def kept(tiny_model):
    kept = Kept(lambda: start_tokenizer(tiny_model))
    yield kept
    kept.close()


@pytest.fixture
def front(kept) -> "Front":
    """The module's tokenizer process (started again if a case stopped it)."""
    rig = kept.get()
    rig.fakes["scheduler"].drain()
    return Front(rig)


class Front:
    """The fake scheduler and the fake detokenizer around one tokenizer process."""

    def __init__(self, rig: Rig):
        self.rig, self.sched = rig, rig.fakes["scheduler"]

    def client(self) -> Client:
        return Client(self.rig.client_address, timeout=TIMEOUT_S)

    def http(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.rig.http_address + "/v1", api_key="unused",
                             max_retries=0, timeout=TIMEOUT_S)

    def received(self, timeout: float = TIMEOUT_S) -> m.TokenizedRequest:
        return self.sched.expect(m.TokenizedRequest, timeout)

    def text(self, rid: str, pieces: list[tuple[str, list[int]]],
             finish: m.Finish | None = None) -> None:
        """One TextBatch per piece (text, ids) for rid, the last one carrying `finish`."""
        for k, (text, ids) in enumerate(pieces):
            last = k == len(pieces) - 1
            batch = m.TextBatch(rids=[rid], texts=[text], counts=[len(ids)],
                                token_ids=pack_ids(ids),
                                finished=[finish] if finish and last else [])
            self.rig.send(batch)
        if finish and not pieces:
            self.rig.send(m.TextBatch(rids=[], texts=[], counts=[], token_ids=b"",
                                      finished=[finish]))

    def nothing_reaches_the_scheduler(self) -> None:
        got = self.sched.poll(QUIET_S)
        assert got is None, f"the fake scheduler got {got!r}"


def new_req_id() -> str:
    return f"t{next(_ids)}"


def finish(rid: str, prompt: int, completion: int, reason: str = "length") -> m.Finish:
    return m.Finish(rid=rid, reason=reason, prompt_tokens=prompt, completion_tokens=completion)


# -- ZMQ ---------------------------------------------------------------------------------------


def test_a_client_request_reaches_the_scheduler_tokenized_with_its_parameters(front, tokenizer):
    prompt = "The capital of France is"
    with front.client() as c:
        replies = c.generate(prompt, max_new_tokens=7, temperature=0.5, top_k=20, seed=3,
                             stop_token_ids=[42], stream=True, req_id=new_req_id())
        tr = front.received()
        assert unpack_ids(tr.input_ids) == tokenizer.encode(prompt)
        p = tr.params
        assert (p.max_new_tokens, p.temperature, p.top_k, p.seed, p.stop_token_ids) == \
            (7, 0.5, 20, 3, [42])
        assert (p.constraint_kind, p.constraint) == ("", "")
        front.text(tr.rid, [], finish(tr.rid, len(unpack_ids(tr.input_ids)), 0, "abort"))
        assert list(replies)[-1].finish_reason == "abort"
    # Token ids sent as they are stay as they are.
    with front.client() as c:
        replies = c.generate([5, 6, 7, 8], max_new_tokens=2, stream=True, req_id=new_req_id())
        tr = front.received()
        assert unpack_ids(tr.input_ids) == [5, 6, 7, 8]
        front.text(tr.rid, [], finish(tr.rid, 4, 0, "abort"))
        assert list(replies)[-1].finish_reason == "abort"


def test_text_batches_stream_back_as_deltas_then_one_finished(front, tokenizer):
    with front.client() as c:
        replies = c.generate("Say hello", max_new_tokens=5, stream=True, req_id=new_req_id())
        tr = front.received()
        n_prompt = len(unpack_ids(tr.input_ids))
        pieces = [("Hel", [9707]), ("lo", [385]), ("", [11]), (" world", [1879, 0])]
        front.text(tr.rid, pieces, finish(tr.rid, n_prompt, 5))
        got = list(replies)
    # Each TextBatch is one Delta, as it came (also one with ids and no text yet), then
    # the Finished with every id and the counts.
    assert got[:-1] == ["Hel", "lo", "", " world"]
    done = got[-1]
    assert isinstance(done, m.Finished)
    assert done.text == "Hello world"
    assert done.token_ids == [9707, 385, 11, 1879, 0]
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == \
        ("length", n_prompt, 5)
    front.nothing_reaches_the_scheduler()


def test_a_non_streamed_request_gets_the_whole_text_in_one_finished(front):
    with front.client() as c:
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(c.generate, "Count", max_new_tokens=3, req_id=new_req_id())
            tr = front.received()
            front.text(tr.rid, [("one", [1]), (" two", [2])], finish(tr.rid, 1, 2, "stop"))
            done = reply.result(TIMEOUT_S)
    assert (done.text, done.token_ids, done.finish_reason) == ("one two", [1, 2], "stop")


def test_an_abort_from_the_client_reaches_the_scheduler_as_abort(front):
    with front.client() as c:
        req_id = new_req_id()
        replies = c.generate("Tell me a long story", max_new_tokens=500, stream=True,
                             req_id=req_id)
        tr = front.received()
        front.text(tr.rid, [("Once", [7454])])
        assert next(replies) == "Once"
        c.abort(req_id)
        assert front.sched.expect(m.Abort) == m.Abort(rid=tr.rid)
        # The request stays open until the scheduler's terminal reply, which the client gets.
        front.text(tr.rid, [], finish(tr.rid, 5, 1, "abort"))
        done = list(replies)[-1]
    assert (done.finish_reason, done.token_ids) == ("abort", [7454])
    front.nothing_reaches_the_scheduler()


def test_an_error_finish_is_the_clients_server_error(front):
    with front.client() as c:
        replies = c.generate("x", max_new_tokens=3, stream=True, req_id=new_req_id())
        tr = front.received()
        front.text(tr.rid, [], m.Finish(rid=tr.rid, reason="error", prompt_tokens=1,
                                        completion_tokens=0, message="model runner failed: "
                                        "boom", code=500))
        with pytest.raises(ServerError) as e:
            list(replies)
    assert (e.value.code, e.value.message) == (500, "model runner failed: boom")


@pytest.mark.parametrize("prompt, fields, said", [
    ("p", {"temperature": -1.0}, "temperature"),
    ("both", {"input_ids": [1, 2]}, "only one of prompt"),
    (None, {"input_ids": [10**9]}, "outside the vocabulary"),
    ("p", {"regex": "a", "json_schema": '{"type": "object"}'}, "at most one"),
    ("p", {"json_schema": '{"type": "no-such-type"}'}, "json_schema"),
], ids=["range", "two-prompts", "vocabulary", "two-constraints", "bad-schema"])
def test_a_bad_request_gets_a_400_and_nothing_reaches_the_scheduler(front, prompt, fields,
                                                                     said):
    with front.client() as c:
        with pytest.raises(ServerError) as e:
            c.generate(prompt, max_new_tokens=4, req_id=new_req_id(), **fields)
    assert e.value.code == 400 and said in e.value.message, e.value.message
    front.nothing_reaches_the_scheduler()


# -- HTTP --------------------------------------------------------------------------------------


def test_an_http_completion_is_answered_the_same_way(front, tokenizer):
    prompt = "The capital of France is"
    with ThreadPoolExecutor(1) as pool:
        reply = pool.submit(front.http().completions.create, model="qwen3-tiny",
                            prompt=prompt, max_tokens=6, temperature=0)
        tr = front.received()
        ids = unpack_ids(tr.input_ids)
        assert ids == tokenizer.encode(prompt)
        assert (tr.params.max_new_tokens, tr.params.temperature) == (6, 0.0)
        front.text(tr.rid, [(" Paris", [12095]), (".", [13])], finish(tr.rid, len(ids), 2,
                                                                       "stop"))
        r = reply.result(TIMEOUT_S)
    assert r.choices[0].text == " Paris." and r.choices[0].finish_reason == "stop"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 2)
    front.nothing_reaches_the_scheduler()


def test_an_http_chat_stream_gets_each_text_batch_as_a_chunk(front, tokenizer):
    msgs = [{"role": "user", "content": "你好 🎉"}]
    chunks: list[Any] = []

    def read() -> None:
        stream = front.http().chat.completions.create(model="qwen3-tiny", messages=msgs,
                                                      max_tokens=9, stream=True)
        chunks.extend(stream)

    with ThreadPoolExecutor(1) as pool:
        done = pool.submit(read)
        tr = front.received()
        assert unpack_ids(tr.input_ids) == tokenizer.apply_chat_template(msgs)
        front.text(tr.rid, [("Hi", [13048]), (" there", [1052])],
                   finish(tr.rid, 5, 2, "length"))
        done.result(TIMEOUT_S)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Hi there"
    assert [c.choices[0].finish_reason for c in chunks if c.choices
            and c.choices[0].finish_reason] == ["length"]


def test_an_http_abort_by_a_gone_client_reaches_the_scheduler(front):
    """The HTTP client reads one chunk and closes the connection: the request is aborted."""
    with ThreadPoolExecutor(1) as pool:
        got_one = threading.Event()

        def read_one() -> None:
            stream = front.http().completions.create(model="qwen3-tiny", prompt="go on",
                                                     max_tokens=500, stream=True)
            for _ in stream:
                got_one.set()
                break
            stream.close()

        done = pool.submit(read_one)
        tr = front.received()
        front.text(tr.rid, [("a", [64])])
        assert got_one.wait(TIMEOUT_S), "the first chunk never came"
        done.result(TIMEOUT_S)
        assert front.sched.expect(m.Abort) == m.Abort(rid=tr.rid)
        front.text(tr.rid, [], finish(tr.rid, 2, 1, "abort"))


@pytest.mark.parametrize("body", [{"prompt": "p", "max_tokens": 0},
                                  {"prompt": "p", "temperature": "hot"},
                                  {"prompt": [], "max_tokens": 3},
                                  b'{"prompt": "p", "max_tokens":'],
                         ids=["max_tokens", "type", "empty-prompt", "not-json"])
def test_a_bad_http_request_gets_a_400_and_nothing_reaches_the_scheduler(front, body):
    data = body if isinstance(body, bytes) else json.dumps({"model": "qwen3-tiny", **body})
    req = urllib.request.Request(front.rig.http_address + "/v1/completions", data=data.encode()
                                 if isinstance(data, str) else data,
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=TIMEOUT_S)
    assert e.value.code == 400
    error = json.loads(e.value.read())["error"]
    assert error["message"] and error["type"] == "invalid_request_error", error
    front.nothing_reaches_the_scheduler()


def test_shutdown_answers_open_requests_and_exits_0(front):
    with front.client() as c:
        replies = c.generate("open", max_new_tokens=50, stream=True, req_id=new_req_id())
        front.received()
        assert front.rig.shutdown(timeout=10.0) == 0
        with pytest.raises(ServerError) as e:
            list(replies)
    assert e.value.code == 503 and "shutting down" in e.value.message
    assert not front.rig.inbox_file().exists()


# -- a slow grammar compile --------------------------------------------------------------------

SLOW_SCHEMA = json.dumps({"title": slow_grammar.SLOW_TITLE, "type": "object",
                          "properties": {"a": {"type": "integer"}}, "required": ["a"]})
NORMAL_SCHEMA = json.dumps({"type": "object", "properties": {"b": {"type": "string"}},
                            "required": ["b"]})
STREAMS = 4
PUSH_EVERY_S = 0.02
MAX_GAP_S = 0.2
SECOND_WITHIN_S = 1.0


class Timed:
    """A client request on a thread of its own; when it was sent, every piece's arrival."""

    def __init__(self, address: str, prompt: str, **kw):
        self.address, self.prompt, self.kw = address, prompt, kw
        self.sent = 0.0
        self.arrivals: list[tuple[float, str]] = []
        self.result: m.Finished | None = None
        self.done_at = 0.0
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Timed":
        self.thread.start()
        return self

    def _run(self) -> None:
        try:
            with Client(self.address, timeout=15.0) as c:
                self.sent = time.monotonic()
                for piece in c.generate(self.prompt, stream=True, req_id=new_req_id(),
                                        **self.kw):
                    now = time.monotonic()
                    if isinstance(piece, str):
                        self.arrivals.append((now, piece))
                    else:
                        self.result, self.done_at = piece, now
        except BaseException as e:  # noqa: BLE001 - reported by the test
            self.error = e

    def join(self, timeout: float) -> m.Finished:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), f"{self.prompt!r}: no Finished within {timeout} s"
        assert self.error is None, f"{self.prompt!r}: {self.error!r}"
        return self.result


class Pusher:
    """The fake detokenizer's stream: every PUSH_EVERY_S one token for each rid, its text the
    batch's number, until stopped; then a Finish for each."""

    def __init__(self, rig: Rig, rids: list[str], prompt_tokens: dict[str, int]):
        self.sock, self.rids, self.prompt_tokens = rig.pusher(), rids, prompt_tokens
        self.sent: list[float] = []  # batch number -> when it was sent
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = len(self.rids)
        while not self.stop.is_set():
            k = len(self.sent)
            self.sock.send(encode(m.TextBatch(rids=self.rids, texts=[f"<{k}>"] * n,
                                              counts=[1] * n,
                                              token_ids=pack_ids([100 + k % 900] * n))))
            self.sent.append(time.monotonic())
            self.stop.wait(PUSH_EVERY_S)  # pacing, not synchronization
        self.sock.send(encode(m.TextBatch(
            rids=[], texts=[], counts=[], token_ids=b"",
            finished=[finish(r, self.prompt_tokens[r], len(self.sent)) for r in self.rids])))


def receive_until(front: Front, pred, what: str, timeout: float) -> tuple[m.TokenizedRequest,
                                                                          float]:
    """The next message at the fake scheduler, which must be the TokenizedRequest pred
    accepts, and when it arrived."""
    started = time.monotonic()
    tr = front.sched.recv(timeout, what=what)
    at = time.monotonic()
    assert isinstance(tr, m.TokenizedRequest), f"while waiting for {what}: {tr!r}"
    if not pred(tr):
        pytest.fail(f"while waiting for {what} the fake scheduler got another request first: "
                    f"prompt ids {unpack_ids(tr.input_ids)}, constraint "
                    f"{tr.params.constraint_kind or 'none'}, {at - started:.3f} s into the wait")
    return tr, at


def gaps(times: list[float], start: float, end: float) -> list[float]:
    """Gaps between consecutive arrivals that overlap [start, end] (the one running into the
    window from the last arrival before it counts)."""
    out = []
    for a, b in zip(times, times[1:]):
        if b >= start and a <= end:
            out.append(b - a)
    return out


@pytest.fixture
def slow_front(tiny_model):
    rig = start_tokenizer(tiny_model, entry="tests.support.slow_grammar:main")
    try:
        yield Front(rig)
    finally:
        rig.close()


def test_a_slow_grammar_compile_stalls_neither_streams_nor_other_requests(slow_front,
                                                                          tokenizer):
    """limits.grammar_timeout_s is 10 s (the default); one schema compiles for 5 s. While it
    does: (a) four streams, fed a token each every 20 ms, never wait 200 ms between deltas;
    (b) a second constrained request, sent 0.5 s into the slow compile, reaches the
    scheduler within a second and gets its Finished as soon as the scheduler ends it; (c) the
    slow one reaches the scheduler once its compile is done, ~5 s after it was sent."""
    front = slow_front
    address = front.rig.client_address
    assert front.rig.cfg.limits.grammar_timeout_s == 10.0
    streams = [Timed(address, f"stream {i}", max_new_tokens=100_000).start()
               for i in range(STREAMS)]
    opened = [front.received() for _ in range(STREAMS)]
    rids = [tr.rid for tr in opened]
    pusher = Pusher(front.rig, rids, {tr.rid: len(unpack_ids(tr.input_ids)) for tr in opened})
    pusher.thread.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while min(len(s.arrivals) for s in streams) < 5:  # every stream is flowing
            assert time.monotonic() < deadline, "the streams did not start"
            assert all(s.thread.is_alive() for s in streams), [s.error for s in streams]
            time.sleep(0.01)

        slow = Timed(address, "slow one", json_schema=SLOW_SCHEMA, max_new_tokens=4).start()
        time.sleep(0.5)  # the second request goes 0.5 s into the slow compile (checked below)
        second = Timed(address, "second one", json_schema=NORMAL_SCHEMA,
                       max_new_tokens=4).start()

        second_ids = tokenizer.encode("second one")
        tr2, at2 = receive_until(front, lambda tr: unpack_ids(tr.input_ids) == second_ids,
                                 "the second constrained request", 2 * TIMEOUT_S)
        assert (tr2.params.constraint_kind, bool(tr2.params.constraint)) == \
            ("json_schema", True)
        assert at2 - second.sent < SECOND_WITHIN_S, \
            f"the second constrained request took {at2 - second.sent:.3f} s to reach the " \
            "scheduler: it waited for the slow compile"
        ended = time.monotonic()
        front.text(tr2.rid, [('{"b": "x"}', [5, 6])], finish(tr2.rid, len(second_ids), 2, "stop"))
        done2 = second.join(TIMEOUT_S)
        assert (done2.text, done2.finish_reason) == ('{"b": "x"}', "stop")
        assert second.done_at - ended < MAX_GAP_S, \
            f"its Finished came {second.done_at - ended:.3f} s after the scheduler ended it"

        slow_ids = tokenizer.encode("slow one")
        tr1, at1 = receive_until(front, lambda tr: unpack_ids(tr.input_ids) == slow_ids,
                                 "the slow constrained request", 2 * slow_grammar.SLOW_S)
        took = at1 - slow.sent
        assert slow_grammar.SLOW_S - 0.2 <= took < front.rig.cfg.limits.grammar_timeout_s, \
            f"the slow request reached the scheduler {took:.3f} s after it was sent"
        assert second.sent < at1, "the second request was not sent during the slow compile"
        assert (tr1.params.constraint_kind, bool(tr1.params.constraint)) == \
            ("json_schema", True)
        front.text(tr1.rid, [('{"a": 1}', [7])], finish(tr1.rid, len(slow_ids), 1, "stop"))
        assert slow.join(TIMEOUT_S).text == '{"a": 1}'
    finally:
        pusher.stop.set()
        pusher.thread.join(TIMEOUT_S)
    for s in streams:
        assert s.join(TIMEOUT_S).finish_reason == "length"

    window = (slow.sent, at1)
    pushed = gaps(pusher.sent, *window)
    for i, s in enumerate(streams):
        times = [t for t, _ in s.arrivals]
        got = gaps(times, *window)
        # Each delta's text names its batch: how long the tokenizer took to pass it on.
        late = [t - pusher.sent[int(text[1:-1])] for t, text in s.arrivals
                if window[0] <= t <= window[1]]
        assert len(got) >= (window[1] - window[0]) / MAX_GAP_S, \
            f"stream {i}: only {len(got)} deltas during the slow compile"
        assert max(got) < MAX_GAP_S, (
            f"stream {i}: a gap of {max(got) * 1000:.0f} ms between deltas during the slow "
            f"compile (the fake detokenizer's largest gap between batches: "
            f"{max(pushed) * 1000:.0f} ms; the largest delay of a delta behind its batch: "
            f"{max(late) * 1000:.0f} ms)")
