"""The intake boundary and the tokenizer core behind it: every client input ends as one reply
or one encoded TokenizedRequest, never an exception; a request is open only once encoded."""

from __future__ import annotations

import msgspec
import pytest

from models.info import ModelInfo
from actors.tokenizer.frontend import Frontend
from actors.tokenizer.intake import RequestError, check_value, decode_body, decode_frame
from actors.tokenizer.openai_format import ChatBody
from protocol import messages as m
from protocol.config import LimitsConfig

MODEL = ModelInfo(path="", name="fake", context_length=64, eos_ids=[0], vocab_size=1000,
                  model_type="fake")
LIMITS = LimitsConfig(max_depth=8, max_string_chars=100, max_list_items=50)


class FakeTokenizer:
    """Bytes as token ids; a prompt can ask it to misbehave like a buggy tokenizer would."""

    def encode(self, text: str) -> list[int]:
        if text == "raise":
            raise RuntimeError("cannot encode this")  # the prompt's problem: a 400
        if text == "str":
            return "ids"  # a bug: no list of ids
        if text == "huge":
            return [2**40]  # no int32: encoding the TokenizedRequest fails
        return list(text.encode())

    def apply_chat_template(self, messages, **kwargs) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


def frontend() -> Frontend:
    return Frontend(FakeTokenizer(), MODEL, limits=LIMITS)


def frame(**fields) -> list[bytes]:
    return [b"id", msgspec.msgpack.encode({"type": 1, "req_id": "r", **fields})]


def test_a_valid_frame_opens_one_request_encoded_for_the_scheduler():
    front = frontend()
    replies, forward = front.on_client(frame(prompt="hi", max_new_tokens=3), 0.0)
    assert replies == [] and len(forward) == 1 and len(front.open) == 1
    [(replica, data)] = forward
    sent = msgspec.msgpack.decode(data, type=m.SchedulerInbox)
    assert replica == 0
    assert isinstance(sent, m.TokenizedRequest) and sent.params.max_new_tokens == 3


@pytest.mark.parametrize("prompt,code,text", [
    ("raise", 400, "prompt: cannot be tokenized"),
    ("str", 500, "internal error: TypeError"),
    ("huge", 500, "internal error: OverflowError"),
    ("x" * 101, 400, "limits.max_string_chars"),
])
def test_a_failing_request_gets_one_error_and_is_never_opened(prompt, code, text):
    front = frontend()
    replies, forward = front.on_client(frame(prompt=prompt), 0.0)
    assert forward == [] and front.open == {} and front.by_client == {}
    [(identity, reply)] = replies
    assert identity == b"id" and isinstance(reply, m.ErrorReply)
    assert (reply.code, reply.req_id) == (code, "r") and text in reply.message
    assert front.internal_errors == (code == 500)
    # The same req_id can be used again: nothing of the failed one is left behind.
    assert front.on_client(frame(prompt="ok"), 0.0)[1]


@pytest.mark.parametrize("payload,text", [
    (msgspec.msgpack.encode({"type": 1, "req_id": "r", "prompt": "P"}).replace(b"P", b"\xff"),
     "UTF-8"),
    (msgspec.msgpack.encode({"type": 1, "req_id": "r", "chat_template_kwargs": {"a": 0}})
     .replace(b"\xa1a\x00", b"\xa1a" + b"\x91" * 50_000 + b"\xc0"), "max_depth"),
    (b"", "malformed"),
    (msgspec.msgpack.encode({"type": 1, "req_id": "r", "prompt": "hi", "seed": 2**64 - 1}),
     "seed"),
])
def test_undecodable_frames_are_request_errors(payload, text):
    with pytest.raises(RequestError, match=text):
        decode_frame(payload, LIMITS)


def test_frame_size_is_checked_before_decoding():
    payload = msgspec.msgpack.encode({"type": 1, "req_id": "r", "prompt": "hi"})
    with pytest.raises(RequestError, match="limits.max_frame_bytes"):
        decode_frame(payload, LimitsConfig(max_frame_bytes=len(payload) - 1))


def test_free_form_values_are_walked_without_recursion():
    deep: list = []
    for _ in range(100_000):  # deeper than Python could recurse
        deep = [deep]
    with pytest.raises(RequestError, match="max_depth"):
        check_value("chat_template_kwargs", {"a": deep}, LIMITS)
    with pytest.raises(RequestError, match="max_list_items"):
        check_value("chat_template_kwargs", {"a": list(range(51))}, LIMITS)
    with pytest.raises(RequestError, match="max_string_chars"):
        check_value("chat_template_kwargs", {"k" * 101: 1}, LIMITS)
    check_value("chat_template_kwargs", {"a": [[1, "x"], {"b": None}]}, LIMITS)


def test_http_bodies_name_the_field_and_cap_the_size():
    with pytest.raises(RequestError) as e:
        decode_body(b'{"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}',
                    ChatBody, LIMITS)
    assert e.value.code == 400 and e.value.param == "messages" and "text" in e.value.message
    with pytest.raises(RequestError) as e:
        decode_body(b"{}" + b" " * 200, ChatBody, LimitsConfig(max_body_bytes=100))
    assert e.value.code == 413


def test_a_refusal_echoes_the_req_id_however_long():
    """The async client matches replies by req_id; one with "" fails every request it has
    open, so a refused frame's req_id comes back whole."""
    long_id = "x" * 300
    [(_, reply)] = frontend().on_client(frame(req_id=long_id, prompt="hi", temperature=-1.0),
                                        0.0)[0]
    assert isinstance(reply, m.ErrorReply) and reply.req_id == long_id


@pytest.mark.parametrize("asked,cap,sent", [(500, 16, 16), (8, 16, 8), (500, 0, 500)])
def test_limits_max_output_tokens_caps_what_a_request_may_ask(asked, cap, sent):
    """An agent asks 32000 output tokens by default: the server's cap holds (0: none)."""
    front = Frontend(FakeTokenizer(), MODEL,
                     limits=LimitsConfig(max_output_tokens=cap))
    _, [(_, data)] = front.on_client(frame(prompt="hi", max_new_tokens=asked,
                                           min_new_tokens=min(asked, 12)), 0.0)
    params = msgspec.msgpack.decode(data, type=m.SchedulerInbox).params
    assert params.max_new_tokens == sent
    assert params.min_new_tokens == min(asked, 12, sent)


def test_a_session_routes_every_request_to_its_first_replica():
    """The frontend hands the request's session to the router: an agent's turns stay on the
    replica whose prefix cache holds the conversation, whatever the load."""
    from actors.tokenizer.router import Router
    front = Frontend(FakeTokenizer(), MODEL, limits=LIMITS, router=Router(2, slack=0))
    replicas = []
    for k in range(4):
        _, [(replica, _)] = front.on_client([b"id", msgspec.msgpack.encode(
            {"type": 1, "req_id": f"r{k}", "prompt": f"turn {k}", "session": "s1",
             "max_new_tokens": 2})], 0.0)
        replicas.append(replica)
    assert len(set(replicas)) == 1
    _, [(other, _)] = front.on_client([b"id", msgspec.msgpack.encode(
        {"type": 1, "req_id": "x", "prompt": "other", "max_new_tokens": 2})], 0.0)
    assert other != replicas[0]  # without a session: the least loaded
