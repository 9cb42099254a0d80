"""The SSE body of a streamed completion: replies already queued go out as one write; a reply
still to come ends the write before it; a bug ends the stream with an error event."""

from __future__ import annotations

import asyncio
import json

from actors.tokenizer.http import _stream
from protocol import messages as m

OPTS = {"stream": True, "logprobs": None, "include_usage": True, "token_text": str}


class Bridge:
    model_name = "m"
    strict_model_name = False

    def __init__(self):
        self.aborted: list[str] = []
        self.errors = 0

    def internal_error(self) -> None:
        self.errors += 1

    def abort(self, req_id: str) -> None:
        self.aborted.append(req_id)


def _finished(req_id: str, tokens: list[int]) -> m.Finished:
    return m.Finished(req_id=req_id, text="", token_ids=tokens, finish_reason="length",
                      prompt_tokens=3, completion_tokens=len(tokens))


async def _writes(replies_now: list, replies_later: list) -> tuple[list[bytes], Bridge]:
    queue: asyncio.Queue = asyncio.Queue()
    for r in replies_now[1:]:
        queue.put_nowait(r)
    bridge = Bridge()
    reqs = [m.GenerateRequest(req_id="a", input_ids=[1, 2, 3])]
    body = _stream(bridge, reqs, {"a": 0}, queue, replies_now[0], OPTS, False, "cmpl-x", 0)
    writes = []
    async for w in body:
        writes.append(w)
        for r in replies_later[:1]:
            queue.put_nowait(r)
        replies_later = replies_later[1:]
    return writes, bridge


def _events(write: bytes) -> list:
    write = write.decode()
    assert write.endswith("\n\n")
    return [e[len("data: "):] for e in write.split("\n\n") if e]


def test_a_last_token_its_finish_usage_and_done_that_arrive_together_are_one_write():
    writes, bridge = asyncio.run(_writes(
        [m.Delta(req_id="a", text="hi", token_ids=[7]), _finished("a", [7])], []))
    assert len(writes) == 1
    token, finish, usage, done = _events(writes[0])
    assert json.loads(token)["choices"][0]["text"] == "hi"
    assert json.loads(finish)["choices"][0]["finish_reason"] == "length"
    assert json.loads(usage)["usage"]["completion_tokens"] == 1
    assert done == "[DONE]" and bridge.aborted == [] and bridge.errors == 0


def test_a_token_is_written_before_a_reply_that_has_not_arrived():
    writes, bridge = asyncio.run(_writes(
        [m.Delta(req_id="a", text="x", token_ids=[5])],
        [m.Delta(req_id="a", text="y", token_ids=[6]), _finished("a", [5, 6])]))
    # The first token alone; the second came once the first was written, its end after it.
    assert [len(_events(w)) for w in writes] == [1, 1, 3]
    assert json.loads(_events(writes[0])[0])["choices"][0]["text"] == "x"
    assert bridge.aborted == []


def test_a_bug_while_streaming_ends_the_stream_with_an_error_event_and_is_counted():
    # A reply naming a request this stream does not serve: the lookup fails (a bug's shape).
    writes, bridge = asyncio.run(_writes(
        [m.Delta(req_id="a", text="ok", token_ids=[7])],
        [m.Delta(req_id="zz", text="x", token_ids=[8])]))
    assert json.loads(_events(writes[0])[0])["choices"][0]["text"] == "ok"
    (error,) = _events(writes[-1])
    assert json.loads(error)["error"]["message"] == "internal error: KeyError"
    assert bridge.errors == 1
    assert bridge.aborted == ["a"]  # the request is freed
