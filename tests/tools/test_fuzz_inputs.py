"""The fuzz job's pure parts: raw encoders, schema bounds, mutations, the drawn cases' verdicts
against the server's own decoders, and the criteria (tools/fuzz/)."""

from __future__ import annotations

import json
import math

import msgspec
import pytest

from actors.tokenizer import openai_format as oa
from tools.fuzz import bodies, frames, job
from tools.fuzz.cases import BAD, MAX_NEW, OK, cases, mutate
from tools.fuzz.wire import (INT64_MIN, UINT64_MAX, Ext, F32, Str, bounds_of,
                                  claimed_req_id, fields_of, nest, pack, to_json)
from protocol import messages as m

PLAIN = [0, 1, -1, -33, 127, 128, 255, 256, 65535, 65536, 2**32, UINT64_MAX, INT64_MIN, 1.5,
         "a" * 40, "é", [1] * 20, {"a": [1, {"b": None}]}, True, None, b"xy", "x" * 70_000]


@pytest.mark.parametrize("value", PLAIN, ids=repr)
def test_pack_agrees_with_msgspec(value):
    assert msgspec.msgpack.decode(pack(value)) == value


def test_pack_says_what_msgspec_will_not():
    with pytest.raises((UnicodeDecodeError, msgspec.DecodeError)):  # msgspec 0.22: the former
        msgspec.msgpack.decode(pack({"req_id": Str(b"a\xffb")}))
    assert math.isnan(msgspec.msgpack.decode(pack(F32(math.nan))))
    assert msgspec.msgpack.decode(pack([Ext(5, b"abcd")]))[0].code == 5
    with pytest.raises(ValueError):
        pack(UINT64_MAX + 1)


def test_nesting_and_json():
    deep = msgspec.msgpack.decode(pack({"a": nest(50, False, False)}))
    for _ in range(51):  # the map, then 50 arrays
        deep = deep["a"] if isinstance(deep, dict) else deep[0]
    assert deep is None
    assert json.loads(to_json({"a": math.nan, "b": [math.inf], "c": "\ud800"}))["c"] == "\ud800"
    assert to_json({"p": Str(b"\xff")}) == b'{"p":"\xff"}'
    assert json.loads(nest(20, True, True).data) is not None


def test_bounds_come_from_the_schema():
    wire = fields_of(m.GenerateRequest)
    top_p = bounds_of(wire["top_p"].type)
    assert not top_p.holds(0.0) and top_p.holds(1.0) and not top_p.holds(1.0001)
    assert not top_p.holds(math.nan)
    assert bounds_of(wire["seed"].type).holds(0)  # Optional: None taken out of the union


def test_mutations_are_deterministic():
    ops = [("flip", 0.5, 0.0, 3, b"x"), ("insert", 0.1, 0.0, 0, b"zz"),
           ("repeat", 0.2, 0.6, 1, b"")]
    assert mutate(b"0123456789", b"abc", ops) == mutate(b"0123456789", b"abc", ops)
    assert mutate(b"0123456789", b"abc", [("truncate", 0.3, 0.0, 0, b"")]) == b"012"
    assert mutate(b"0123456789", b"abc", [("splice", 0.5, 0.0, 0, b"")]) == b"01234abc"


def test_claimed_req_id():
    assert claimed_req_id(pack({"req_id": "x", "prompt": 5})) == "x"
    assert claimed_req_id(pack({"req_id": Str(b"\xff")})) is None
    assert claimed_req_id(b"\x91" * 100_000 + b"\xc0") is None


MODEL = dict(vocab=1000, context=512, count_tokens=lambda text: len(text) // 4)


def test_valid_zmq_requests_decode_and_stay_cheap():
    drawn = list(cases(frames.Frames(**MODEL).request(odd=0), frames.finish, 60, seed_=3))
    decoder = msgspec.msgpack.Decoder(m.ClientInbound)
    for case in drawn:
        assert case.verdict == OK, case.show()
        req = decoder.decode(case.frames[0])
        assert req.req_id == case.req_id and 1 <= req.max_new_tokens <= MAX_NEW
        assert sum(map(bool, (req.prompt, req.input_ids, req.messages))) == 1
        assert all(0 <= t < 1000 for t in [*req.input_ids, *req.stop_token_ids])


def test_schema_refusals_are_refused_by_the_schema():
    """A case judged bad for a wrong type or range fails the server's typed decoding."""
    decoder = msgspec.msgpack.Decoder(m.ClientInbound)
    judged = [c for c in cases(frames.Frames(**MODEL).request("one"), frames.finish, 150, 4)
              if c.verdict == BAD and ("wrong type" in c.note or "out of range" in c.note)]
    assert judged
    for case in judged:
        with pytest.raises((msgspec.DecodeError, msgspec.ValidationError)):
            decoder.decode(case.frames[0])


@pytest.mark.parametrize("chat", [False, True])
def test_valid_http_bodies_fit_the_openai_schema(chat):
    body_type = oa.ChatBody if chat else oa.CompletionBody
    for case in cases(bodies.Bodies(**MODEL).request(chat, odd=0), bodies.finish, 40, 5):
        assert case.verdict == OK, case.show()
        body = msgspec.json.decode(case.body, type=body_type)
        cap = getattr(body, "max_completion_tokens", None) or body.max_tokens
        assert cap is None and not chat or cap <= MAX_NEW


def test_criteria_name_what_failed():
    args = job.parse_args(["--scale", "0"])
    tally = {"cases": 0, "failures": {"zmq_5xx": {"count": 1, "examples": ["ErrorReply(500)"]}}}
    report = {"crashes": [], "canary": [{"tokens": [1, 2]}, {"tokens": [1, 3]}],
              "zmq": tally, "http": {"cases": 0}, "soak": {"requests": 0},
              "end": {"exit_code": 0, "pids_left": [], "idle_after_last_request": True,
                      "first_idle": {"free_rows": 16}, "last_idle": {"free_rows": 16}},
              "rss": {"start_mib": 100.0, "end_mib": 120.0}}
    failed = {c["name"] for c in job.criteria(report, args) if not c["ok"]}
    assert failed == {"zmq_no_5xx", "canary_stable"}
