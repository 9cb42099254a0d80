"""The fuzz job's clients (tools/fuzz/job.py): the ZMQ and HTTP fuzz drivers (HTTP through
benchmarks/raw_http.py: any bytes as the body, a stream that can be dropped mid-way), and the
tally of outcomes and failures they fill. Every wait has a timeout; every connection is to the graph
under test on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import msgspec
import zmq
import zmq.asyncio

from tools.fuzz.cases import ANY, BAD, OK, Case
from benchmarks.raw_http import http_call
from protocol import messages as m

EXAMPLES = 5  # offending inputs kept per failure kind
_replies = msgspec.msgpack.Decoder(m.ClientOutbound)
_encode = msgspec.msgpack.Encoder().encode


@dataclass
class Tally:
    """Outcomes of one surface, and its failures with their first few inputs."""

    cases: int = 0
    outcomes: Counter = field(default_factory=Counter)
    by_kind: dict[str, Counter] = field(default_factory=dict)
    failures: dict[str, dict] = field(default_factory=dict)

    def outcome(self, kind: str, outcome: str) -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1

    def fail(self, name: str, detail: str) -> None:
        entry = self.failures.setdefault(name, {"count": 0, "examples": []})
        entry["count"] += 1
        if len(entry["examples"]) < EXAMPLES:
            entry["examples"].append(detail)

    def report(self) -> dict[str, Any]:
        return {"cases": self.cases, "outcomes": dict(sorted(self.outcomes.items())),
                "by_kind": {k: dict(sorted(v.items())) for k, v in sorted(self.by_kind.items())},
                "failures": self.failures}


def judge(tally: Tally, case: Case, ok: bool, code: int, what: str) -> None:
    """The failures one terminal outcome shows: a 5xx other than 503, a valid input refused,
    an invalid one served. `ok`: served; `code`: the error's HTTP-like code otherwise."""
    if not ok and code >= 500 and code != 503:
        tally.fail(f"{case.surface}_5xx", f"{what} <- {case.show()}")
    elif not ok and code != 503 and case.verdict == OK:
        tally.fail("valid_refused", f"{what} <- {case.show()}")
    elif ok and case.verdict == BAD:
        tally.fail("invalid_served", f"{what} <- {case.show()}")


class Feed:
    """Cases drawn by a thread a little ahead of the senders: drawing is CPU work for
    hypothesis, sending is waiting, so the two overlap. `await next()` gives None at the end."""

    def __init__(self, make: Callable[[], Iterable[Case]], ahead: int = 256):
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.room, self.stopped = threading.Semaphore(ahead), threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._draw, args=(make,), daemon=True)
        self.thread.start()

    def _draw(self, make: Callable[[], Iterable[Case]]) -> None:
        try:
            for case in make():
                while not self.room.acquire(timeout=0.5):
                    if self.stopped.is_set():
                        return
                if self.stopped.is_set():
                    return
                self.loop.call_soon_threadsafe(self.queue.put_nowait, case)
        except BaseException as e:  # a bug in drawing: the job reports it, not a hang
            self.error = e
        finally:
            with contextlib.suppress(RuntimeError):  # the loop may be closed already
                self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

    async def next(self) -> Case | None:
        case = await self.queue.get()
        if case is None:
            self.queue.put_nowait(None)  # every worker sees the end
            if self.error is not None:
                raise RuntimeError("drawing the cases failed") from self.error
            return None
        self.room.release()
        return case

    def close(self) -> None:
        self.stopped.set()
        self.thread.join(10)


# -- HTTP ---------------------------------------------------------------------------------------


def _stream_end(data: bytes) -> tuple[bool, int]:
    """A 200 SSE body: (ended with [DONE], the code of an error event in it, or 0)."""
    code = 0
    for line in data.split(b"\n"):
        if line.startswith(b"data: {") and b'"error"' in line[:20]:
            try:
                code = int(json.loads(line[6:])["error"].get("code") or 500)
            except (ValueError, KeyError, AttributeError, TypeError):
                code = 500
    return data.rstrip().endswith(b"data: [DONE]"), code


async def http_fuzz(base: str, cases: Feed, tally: Tally, inflight: dict, conns: int,
                    timeout: float) -> None:
    """`conns` connections at a time, each sending its next case when the last one ended."""

    async def worker(k: int) -> None:
        while (case := await cases.next()) is not None:
            inflight[k] = (time.monotonic(), case)
            await http_one(base, case, tally, timeout)
            inflight.pop(k, None)

    await asyncio.gather(*(worker(k) for k in range(conns)))


async def http_one(base: str, case: Case, tally: Tally, timeout: float) -> None:
    tally.cases += 1
    try:
        status, data = await http_call(base, case.path, case.body, timeout)
    except TimeoutError:
        tally.outcome(case.kind, "timeout")
        tally.fail("http_no_reply", f"no reply in {timeout} s <- {case.show()}")
        return
    except (ConnectionError, OSError, asyncio.IncompleteReadError, ValueError, IndexError) as e:
        tally.outcome(case.kind, "conn_error")
        tally.fail("http_connection", f"{type(e).__name__}: {e} <- {case.show()}")
        return
    tally.outcome(case.kind, str(status))
    what = f"{status} {data[:200]!r}"
    if status == 200 and data.startswith(b"data: "):
        done, code = _stream_end(data)
        if code:
            tally.outcome(case.kind, f"stream_error_{code}")
            judge(tally, case, False, code, f"error event {code} in the stream")
            return
        if not done:
            tally.fail("http_stream_unterminated", f"no [DONE]: {data[-200:]!r} <- {case.show()}")
    judge(tally, case, status == 200, status, what)


# -- ZMQ ----------------------------------------------------------------------------------------


def dealer(ctx: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


@dataclass
class Conn:
    """One fuzz connection: which req_ids were answered already (a second reply is a
    duplicate) and which ones timed out (a reply may still come, late)."""

    sock: zmq.asyncio.Socket
    answered: set[str] = field(default_factory=set)
    late: set[str] = field(default_factory=set)


async def zmq_fuzz(address: str, cases: Feed, tally: Tally, inflight: dict, conns: int,
                   timeout: float, grace: float = 1.0) -> None:
    """`conns` DEALER connections, each sending one case at a time and waiting for its
    terminal reply, so every reply can be matched to the case that caused it."""
    ctx = zmq.asyncio.Context()
    pool = [Conn(dealer(ctx, address)) for _ in range(conns)]

    async def worker(k: int) -> None:
        while (case := await cases.next()) is not None:
            inflight[k] = (time.monotonic(), case)
            await zmq_one(pool[k], case, tally, timeout)
            inflight.pop(k, None)
        await _drain(pool[k], tally, grace)

    try:
        await asyncio.gather(*(worker(k) for k in range(conns)))
    finally:
        for conn in pool:
            conn.sock.close(linger=0)
        ctx.term()


async def zmq_one(conn: Conn, case: Case, tally: Tally, timeout: float) -> None:
    tally.cases += 1
    await conn.sock.send_multipart(case.frames)
    if not case.expect_reply:  # a valid abort of nothing: no reply; one later is a failure
        tally.outcome(case.kind, "no_reply_expected")
        if case.req_id:
            conn.answered.add(case.req_id)
        return
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        if not await conn.sock.poll(left * 1000):
            break
        reply = _decode(await conn.sock.recv_multipart(), tally, case)
        if reply is None or _stray(conn, reply, tally, case):
            continue
        if isinstance(reply, m.Delta):
            continue
        _terminal(conn, reply, tally, case)
        return
    tally.outcome(case.kind, "timeout")
    tally.fail("zmq_no_reply", f"no terminal reply in {timeout} s <- {case.show()}")
    if case.req_id:
        conn.late.add(case.req_id)
        await conn.sock.send(_encode(m.AbortRequest(req_id=case.req_id)))


def _decode(frames: list[bytes], tally: Tally, case: Case) -> Any:
    try:
        (data,) = frames
        return _replies.decode(data)
    except (ValueError, msgspec.DecodeError) as e:
        tally.fail("zmq_bad_reply", f"{e}: {frames!r:.300} while waiting for {case.show()}")
        return None


def _stray(conn: Conn, reply: Any, tally: Tally, case: Case) -> bool:
    """A reply for an earlier case: late (after its timeout) or a second terminal reply."""
    rid = reply.req_id
    if rid and rid != case.req_id and rid in conn.late:
        if not isinstance(reply, m.Delta):
            conn.late.discard(rid)
            conn.answered.add(rid)
        return True
    if rid and rid != case.req_id and rid in conn.answered:
        tally.fail("zmq_duplicate_reply", f"{type(reply).__name__} for {rid!r:.80} after its "
                   f"terminal reply: {reply!r:.300}")
        return True
    return False


def _terminal(conn: Conn, reply: Any, tally: Tally, case: Case) -> None:
    if case.req_id is not None and reply.req_id != case.req_id:
        # Any string req_id is echoed, however long: a client matches replies by it.
        tally.fail("zmq_wrong_req_id", f"reply req_id {reply.req_id!r:.80}, sent "
                   f"{case.req_id!r:.80} <- {case.show()}")
    if case.req_id:
        conn.answered.add(case.req_id)
    if isinstance(reply, m.Finished):
        tally.outcome(case.kind, f"Finished:{reply.finish_reason}")
        judge(tally, case, True, 0, f"Finished({reply.finish_reason})")
    else:
        tally.outcome(case.kind, f"ErrorReply:{reply.code}")
        judge(tally, case, False, reply.code, f"ErrorReply({reply.code}, {reply.message!r:.200})")


async def _drain(conn: Conn, tally: Tally, grace: float) -> None:
    """After the last case: any reply still coming is one too many (or a late one)."""
    end = time.monotonic() + grace
    while (left := end - time.monotonic()) > 0 and await conn.sock.poll(left * 1000):
        reply = _decode(await conn.sock.recv_multipart(), tally, Case("zmq", "drain", ANY))
        if reply is not None and not _stray(conn, reply, tally, Case("zmq", "drain", ANY)):
            tally.fail("zmq_duplicate_reply", f"unexpected reply after the last case: "
                       f"{reply!r:.300}")
