"""A constrained request waits for its grammar off the event loop (actors/tokenizer/compiles.py):
the core starts the compile and answers nothing; `compiled` opens the request once the grammar
is there, refuses it once limits.grammar_timeout_s has passed (its thread runs on, the next
compile does not wait for it), and answers an abort that came meanwhile. The compile is faked
with events the test sets: no sleeps, no timing."""

from __future__ import annotations

import threading

import msgspec
import pytest

from actors import constraints
from actors.constraints import GrammarError
from actors.tokenizer.frontend import Frontend
from protocol import messages as m
from protocol.codec import decoder
from protocol.config import LimitsConfig
from tests.core.test_intake import MODEL, FakeTokenizer

TIMEOUT_S = 10.0
SCHEMA = '{"type": "object"}'


class Tokenizer(FakeTokenizer):
    def specials(self) -> frozenset[str]:
        return frozenset()


class Compile:
    """constraints.compile_constraint, replaced: each call blocks until the test releases its
    source (or raises what the test set for it)."""

    def __init__(self):
        self.entered: dict[str, threading.Event] = {}
        self.release: dict[str, threading.Event] = {}
        self.raises: dict[str, Exception] = {}
        self.lock = threading.Lock()

    def gate(self, source: str) -> tuple[threading.Event, threading.Event]:
        with self.lock:
            return (self.entered.setdefault(source, threading.Event()),
                    self.release.setdefault(source, threading.Event()))

    def __call__(self, kind: str, source: str, specials: frozenset[str]) -> str:
        entered, release = self.gate(source)
        entered.set()
        assert release.wait(30), "the test never released this compile"
        if source in self.raises:
            raise self.raises[source]
        return f"grammar of {source}"


@pytest.fixture
def compile_(monkeypatch):
    fake = Compile()
    monkeypatch.setattr(constraints, "compile_constraint", fake)
    yield fake
    for event in fake.release.values():  # no thread outlives the test
        event.set()


@pytest.fixture
def front():
    f = Frontend(Tokenizer(), MODEL, limits=LimitsConfig(grammar_timeout_s=TIMEOUT_S))
    f.woken = threading.Semaphore(0)
    f.wake = f.woken.release  # called on the compiling thread, as the shell's loop nudge
    return f


def request(req_id: str, schema: str = SCHEMA, **fields) -> m.GenerateRequest:
    return m.GenerateRequest(req_id=req_id, prompt="hi", max_new_tokens=4, json_schema=schema,
                             **fields)


def finish(front: Frontend, compile_: Compile, source: str) -> None:
    """Let `source`'s compile end and wait for its thread's wake."""
    compile_.gate(source)[1].set()
    job = next(c.job for c in front.compiling.values() if c.req.json_schema == source)
    job.exception(timeout=10)  # the thread has set the result (or error)


def opened(forward) -> m.TokenizedRequest:
    [(_, data)] = forward
    return decoder(m.SchedulerInbox).decode(data)


def test_a_constrained_request_opens_once_its_grammar_compiled(front, compile_):
    assert front.submit(b"c", request("a"), now=1.0) == ([], [])
    assert compile_.gate(SCHEMA)[0].wait(10)
    assert set(front.compiling) == {(b"c", "a")} and not front.open
    assert front.next_deadline() == 1.0 + TIMEOUT_S
    assert front.compiled(now=1.5) == ([], [])  # still compiling: nothing yet
    finish(front, compile_, SCHEMA)
    replies, forward = front.compiled(now=2.0)
    msg = opened(forward)
    assert replies == [] and not front.compiling and front.next_deadline() is None
    assert (msg.params.constraint_kind, msg.params.constraint) == ("json_schema",
                                                                   f"grammar of {SCHEMA}")
    assert front.open[msg.rid].received == 1.0  # its time to first token counts the compile


def test_a_compile_past_its_timeout_is_refused_and_the_next_one_does_not_wait_for_it(
        front, compile_):
    slow, fast = '{"title": "slow"}', '{"title": "fast"}'
    front.submit(b"c", request("slow", slow), now=0.0)
    assert compile_.gate(slow)[0].wait(10)
    [(who, reply)], forward = front.compiled(now=TIMEOUT_S)
    assert who == b"c" and forward == [] and isinstance(reply, m.ErrorReply)
    assert reply.code == 400 and "limits.grammar_timeout_s (10 s)" in reply.message
    assert front.compiles.running == 1  # the abandoned compile's thread runs on
    # The next constrained request compiles on a thread of its own, at once.
    front.submit(b"c", request("fast", fast), now=TIMEOUT_S)
    assert compile_.gate(fast)[0].wait(10)
    finish(front, compile_, fast)
    replies, forward = front.compiled(now=TIMEOUT_S + 0.1)
    assert replies == [] and opened(forward).params.constraint == f"grammar of {fast}"
    compile_.gate(slow)[1].set()  # the abandoned compile ends: nobody answers it again
    front.compiles._running.pop().join(10)
    assert front.compiled(now=TIMEOUT_S + 1) == ([], [])
    assert [o.req_id for o in front.open.values()] == ["fast"]


def test_a_grammar_the_library_refuses_is_a_400_naming_the_field(front, compile_):
    compile_.raises[SCHEMA] = GrammarError("json_schema refused: no such keyword")
    front.submit(b"c", request("bad"), now=0.0)
    finish(front, compile_, SCHEMA)
    [(_, reply)], forward = front.compiled(now=0.1)
    assert forward == [] and reply.code == 400
    assert reply.message == "json_schema: json_schema refused: no such keyword"


def test_a_bug_in_the_compile_fails_that_request_alone(front, compile_):
    compile_.raises[SCHEMA] = KeyError("a bug")
    front.submit(b"c", request("bug"), now=0.0)
    finish(front, compile_, SCHEMA)
    [(_, reply)], _ = front.compiled(now=0.1)
    assert reply.code == 500 and front.internal_errors == 1


def test_an_abort_while_it_compiles_is_answered_and_nothing_opens(front, compile_):
    front.submit(b"c", request("a"), now=0.0)
    assert front.on_client([b"c", msgspec.msgpack.encode(
        {"type": 2, "req_id": "a"})], now=0.2) == ([], [])
    [(who, reply)], forward = front.compiled(now=0.3)
    assert who == b"c" and forward == [] and not front.compiling
    assert isinstance(reply, m.Finished) and reply.finish_reason == "abort"
    compile_.gate(SCHEMA)[1].set()
    assert front.compiled(now=0.4) == ([], []) and not front.open


def test_a_gone_client_and_a_shutdown_leave_nothing_compiling(front, compile_):
    front.submit(b"gone", request("a"), now=0.0)
    front.submit(b"stays", request("b", '{"title": "b"}'), now=0.0)
    assert front.client_gone(b"gone") == []
    [(who, reply)], _ = front.compiled(now=0.1)
    assert who == b"gone" and reply.finish_reason == "abort"
    [(who, reply)] = front.fail_all("server is shutting down: test")
    assert who == b"stays" and reply.code == 503 and not front.compiling


def test_a_req_id_compiling_is_open_for_duplicates(front, compile_):
    front.submit(b"c", request("a"), now=0.0)
    [(_, reply)], _ = front.submit(b"c", request("a"), now=0.1)
    assert reply.code == 400 and "already open" in reply.message


def test_past_the_most_compiles_at_once_a_request_is_a_503(front, compile_):
    for k in range(front.compiles.most):
        front.submit(b"c", request(f"r{k}", f'{{"title": "{k}"}}'), now=0.0)
    [(_, reply)], forward = front.submit(b"c", request("over", '{"title": "over"}'), now=0.0)
    assert forward == [] and reply.code == 503 and "compiling already" in reply.message
